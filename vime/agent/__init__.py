"""Agent rollout building blocks where slime's plug-ins import them (``slime.agent`` → ``vime.agent``): HTTP adapters
that serve an agent CLI's OpenAI or Anthropic requests from the policy's engines and turn each session into training
samples (:mod:`vime.agent.adapters`), and a helper to run their aiohttp app on a thread
(:mod:`vime.agent.aiohttp_threaded`). slime's harnesses (Claude Code, Codex) and sandboxes (E2B) are not part of
vime."""
