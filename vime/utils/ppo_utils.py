"""The RL math (DESIGN.md §6): KL estimators, reward shaping, advantages, losses and their reduction.

Pure tensor functions: tensors in, tensors out, no globals, no I/O. Names follow slime. Notation: ``r`` sequence
reward, ``m_t`` loss mask, ``d_t = logp_t − logp_ref_t``. Per-sample quantities are lists of 1-D tensors over
the response tokens (lengths vary); the trainer packs samples into one 1-D token stream for the losses.

Time steps are the loss-masked tokens: a token with ``m_t = 0`` (e.g. tool output inside a multi-turn
response) is not an action, so it carries no reward, is not a discount step and gets zero advantage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


# ---------------------------------------------------------------------------------------------- KL estimators
def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(π‖π_base) estimate (Schulman's k1/k2/k3) from ``d = log_probs − log_probs_base``, in fp32.
    ``importance_ratio`` (π/π_old, ``--use-unbiased-kl``) reweights it to an unbiased estimate under the policy
    that sampled the tokens (DeepSeek-V3.2), before ``low_var_kl``'s clamp."""
    d = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = d
    elif kl_loss_type == "k2":
        kl = d.square() / 2
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-d) + d  # exp(−d) − 1 + d: unbiased and ≥ 0
    else:
        raise ValueError(
            f"unknown kl_loss_type {kl_loss_type!r} (--kl-loss-type); expected one of {KL_LOSS_TYPES}"
        )
    if importance_ratio is not None:
        kl = importance_ratio.float() * kl
    # low_var_kl clamps because exp(−d) explodes when the policy drifts far below the reference.
    return kl.clamp(-10, 10) if kl_loss_type == "low_var_kl" else kl


# ------------------------------------------------------------------------------------------- reward shaping
def normalize_group_rewards(
    rewards: torch.Tensor, n_samples_per_prompt: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO-style shaping of a flat reward vector ordered group by group: ``r − mean(group)``, then
    ``/ (std(group) + eps)`` when ``normalize_std``.

    The std is the *sample* (unbiased, ``n − 1``) std, as slime's ``torch.std`` default; hence groups of one
    sample cannot be std-normalised (ValueError).
    """
    if rewards.dim() != 1 or rewards.numel() % n_samples_per_prompt != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by n_samples_per_prompt={n_samples_per_prompt} "
            f"(--n-samples-per-prompt); got shape {tuple(rewards.shape)}"
        )
    if normalize_std and n_samples_per_prompt < 2:
        raise ValueError(
            "std normalisation needs n_samples_per_prompt >= 2 (the unbiased std of one sample is undefined); "
            "raise --n-samples-per-prompt or pass --disable-grpo-std-normalization"
        )
    groups = rewards.float().view(-1, n_samples_per_prompt)
    shaped = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        shaped = shaped / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    return shaped.flatten()


# ------------------------------------------------------------------------------------------------ advantages
def discounted_cumsum(values: torch.Tensor, discount: float, chunk_size: int = 128) -> torch.Tensor:
    """Reverse discounted cumulative sum of a 1-D tensor: ``out_t = Σ_k discount^k · values_{t+k}``.

    Chunked: one matmul per chunk and a recurrence across chunks, so the sequential part is ``T / chunk_size``
    steps (not one per token) and every power of ``discount`` used stays ≤ 1 (no ``γ^{-t}`` overflow).
    """
    n = values.numel()
    if n == 0:
        return values.clone()
    size = min(chunk_size, n)
    chunks = F.pad(values, (0, (-n) % size)).view(-1, size)  # trailing zeros do not change any sum
    idx = torch.arange(size, device=values.device)
    lag = idx[None, :] - idx[:, None]  # lag[i, j] = j − i
    weights = torch.where(lag >= 0, discount ** lag.clamp(min=0).to(values.dtype), 0.0)
    local = chunks @ weights.T  # sums inside each chunk
    tail = discount ** (size - idx).to(values.dtype)  # discount from position i to the next chunk's start
    out, carry = [], values.new_zeros(())
    for row in reversed(local.unbind(0)):
        row = row + tail * carry
        out.append(row)
        carry = row[0]
    return torch.cat(out[::-1])[:n]


def compute_token_rewards(
    reward: float | torch.Tensor, kl: torch.Tensor, loss_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Token-level rewards for ppo / reinforce++: ``−kl_coef·d_t·m_t``, plus ``r`` on the last masked token.

    A fully masked sample gets no sequence reward (it contributes nothing to the loss anyway).
    """
    mask = loss_mask.to(torch.float32)
    token_rewards = -kl_coef * kl.detach().float() * mask
    masked_positions = mask.nonzero()
    if len(masked_positions) > 0:
        token_rewards[masked_positions[-1, 0]] += reward
    return token_rewards


def get_grpo_returns(rewards: torch.Tensor, kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO / GSPO advantages ``A_t = r̃``: each sample's (already shaped) reward on every token; ``kl`` gives
    the shapes."""
    rewards = rewards.detach().float()
    return [
        torch.ones_like(k, dtype=torch.float32) * r.to(k.device) for r, k in zip(rewards, kl, strict=True)
    ]


def get_reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    kl_coef: float,
    gamma: float,
    all_steps: bool = False,
) -> list[torch.Tensor]:
    """REINFORCE++ returns ``A_t = Σ_k γ^k r_{t+k}`` (k over masked tokens) of ``compute_token_rewards``; 0 at
    unmasked tokens. ``all_steps`` (slime): k runs over every response token, masked ones included (their token
    reward is 0)."""
    returns = []
    for reward, kl_i, loss_mask in zip(rewards, kl, loss_masks, strict=True):
        token_rewards = compute_token_rewards(reward, kl_i, loss_mask, kl_coef)
        selected = torch.ones_like(loss_mask, dtype=torch.bool) if all_steps else loss_mask.bool()
        sample_returns = torch.zeros_like(token_rewards)
        sample_returns[selected] = discounted_cumsum(token_rewards[selected], gamma)
        returns.append(sample_returns)
    return returns


def get_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, kl: list[torch.Tensor], loss_masks: list[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """REINFORCE++-baseline advantages ``A_t = r̃ − kl_coef·d_t·m_t`` (``r̃`` already group-mean-shaped)."""
    rewards = rewards.detach().float()
    return [
        r.to(k.device) - kl_coef * k.detach().float() * m.to(torch.float32)
        for r, k, m in zip(rewards, kl, loss_masks, strict=True)
    ]


def get_advantages_and_returns(
    values: torch.Tensor, rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO GAE for one sample: ``δ_t = r_t + γV_{t+1} − V_t`` (``V`` past the end = 0),
    ``A_t = Σ_k (γλ)^k δ_{t+k}``, ``returns = A + V``; detached.

    Only masked tokens are steps (``V_{t+1}`` is the value at the next masked token; rewards and values at
    ``m_t = 0`` are ignored, since the critic is never trained there); ``A = 0`` and ``returns = V`` elsewhere.
    """
    values, rewards = values.detach().float(), rewards.detach().float()
    selected = loss_mask.bool()
    v, r = values[selected], rewards[selected]
    next_v = torch.zeros_like(v)
    next_v[:-1] = v[1:]
    advantages = torch.zeros_like(values)
    advantages[selected] = discounted_cumsum(r + gamma * next_v - v, gamma * lambd)
    return advantages, advantages + values


def apply_opd_kl(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    opd_kl_coef: float,
) -> torch.Tensor:
    """On-policy distillation: ``A − opd_kl_coef·(logp_student − logp_teacher)``, per token, detached."""
    d = student_log_probs.detach().float() - teacher_log_probs.detach().float()
    return advantages.detach() - opd_kl_coef * d


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values − μ) / sqrt(σ² + eps)`` with the masked mean ``μ`` and masked *unbiased* variance ``σ²``
    (as slime); ``shift_mean=False`` adds ``μ`` back (rescale only). Every position is transformed."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count.item() == 0:
        raise ValueError(
            "masked_whiten: the mask selects no tokens; nothing to whiten (check the loss masks)"
        )
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


# ----------------------------------------------------------------------------------------------------- losses
def compute_gspo_kl(
    log_probs: list[torch.Tensor], old_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor]
) -> torch.Tensor:
    """GSPO sequence-level ``ppo_kl``: per sample the masked mean of ``old − new`` log-probs, broadcast to each
    of its tokens; returned concatenated (packed) like the token stream. A fully masked sample gets 0."""
    per_sample = []
    for new, old, mask in zip(log_probs, old_log_probs, loss_masks, strict=True):
        mask = mask.to(new.dtype)
        seq_kl = ((old - new) * mask).sum() / mask.sum().clamp(min=1)
        per_sample.append(seq_kl.expand_as(new))
    return torch.cat(per_sample)


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped PPO surrogate per token, with ``ratio = exp(−ppo_kl)`` and ``ppo_kl = logp_old − logp``.

    ``loss = max(−ratio·A, −clip(ratio, 1−eps_clip, 1+eps_clip_high)·A)``; dual clip (``eps_clip_c > 1``)
    caps it for ``A < 0`` at ``−eps_clip_c·A``. Returns ``(pg_losses, clipfrac)``, where ``clipfrac`` is 1.0
    on tokens whose clipped term is strictly larger than the unclipped one (the max picked the clipped
    branch; ties count 0; the dual clip does not change it) and 0.0 elsewhere.
    """
    ratio = torch.exp(-ppo_kl)
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = (pg_losses2 > pg_losses1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c={eps_clip_c} (--eps-clip-c) must be > 1 for dual-clip PPO")
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, -eps_clip_c * advantages), pg_losses)
    return pg_losses, clipfrac


def compute_reinforce_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | None = None,
    score_correction: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE per token (``--pg-loss-type reinforce``): ``−A·(sg(w)·logp − c)``, no ratio and no clip.

    ``weights`` ``w``: the sampled token's importance weight (detached; 1 when None). ``score_correction`` ``c``:
    the score-centering term of :func:`score_centering_correction` (0 when None), which subtracts the sampler's
    expected score so that a constant advantage has zero expected gradient (arXiv:2609.20807)."""
    score = log_probs if weights is None else weights.detach() * log_probs
    if score_correction is not None:
        score = score - score_correction
    return -advantages * score


def importance_weights(
    ratio: torch.Tensor, mode: str, low: float | None = None, high: float | None = None
) -> torch.Tensor:
    """Token importance weights of a trainer/sampler probability ratio: ``none`` 1; ``tis`` the ratio clamped to
    ``[low, high]``; ``mis`` (IcePop) the ratio inside ``[low, high]`` and 0 outside. ``low``/``high`` are
    ``--tis-clip-low`` / ``--tis-clip``."""
    if mode == "none":
        return torch.ones_like(ratio)
    if low is None or high is None:
        raise ValueError(f"importance mode {mode!r} needs both bounds (--tis-clip-low, --tis-clip)")
    if mode == "tis":
        return ratio.clamp(low, high)
    if mode == "mis":
        return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    raise ValueError(f"unknown importance mode {mode!r}; expected none, tis or mis")


def score_centering_correction(
    train_head_log_probs: torch.Tensor,
    sampler_head_log_probs: torch.Tensor,
    mode: str = "none",
    low: float | None = None,
    high: float | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score centering from the sampler's top-k head (arXiv:2609.20807, the modeled-tail form).

    Inputs ``[N, k]``: the trainer's (with grad) and the sampler's log-probs at the sampler's k most likely
    tokens, each normalised over the full vocabulary. With head masses ``P = Σ_H p``, ``Q = Σ_H q``, the sampler's
    tail is modeled as the trainer's scaled by ``ρ = (1 − Q) / (1 − P)`` (both floored at ``eps``), so the
    expected weighted score ``Σ_v q_v·w(p_v/q_v)·∇logp_v`` over the whole vocabulary equals the head-only sum
    ``Σ_H sg(q·w(p/q) − α·p)·∇logp`` with ``α = ρ·w(1/ρ)``. Returns ``(correction [N], Q [N], P [N])``; only the
    correction carries gradient, through ``train_head_log_probs``."""
    with torch.no_grad():
        log_p, log_q = train_head_log_probs.float(), sampler_head_log_probs.float()
        p, q = log_p.exp(), log_q.exp()
        p_mass, q_mass = p.sum(-1), q.sum(-1)
        rho = (1 - q_mass).clamp(min=eps) / (1 - p_mass).clamp(min=eps)
        alpha = rho * importance_weights(1 / rho, mode, low, high)
        coefficients = q * importance_weights((log_p - log_q).exp(), mode, low, high) - alpha[:, None] * p
    return (coefficients * train_head_log_probs.float()).sum(-1), q_mass, p_mass


def compute_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic loss per token ``0.5·max((V−R)², (clip(V, V_old−c, V_old+c) − R)²)`` and its clipfrac.

    The 0.5 makes the gradient ``V − R``. ``value_clip=None`` disables clipping (loss ``0.5·(V−R)²``,
    clipfrac 0); otherwise clipfrac is 1.0 where the clipped error is strictly larger.
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def compute_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip_low: float, tis_clip: float
) -> torch.Tensor:
    """Truncated importance-sampling weights ``clamp(exp(logp_old − logp_rollout), tis_clip_low, tis_clip)``,
    detached (they scale ``pg_loss``, they are not optimised)."""
    if tis_clip_low > tis_clip:
        raise ValueError(
            f"tis_clip_low={tis_clip_low} (--tis-clip-low) must be <= tis_clip={tis_clip} (--tis-clip)"
        )
    log_ratio = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    return torch.exp(log_ratio).clamp(tis_clip_low, tis_clip)


# ------------------------------------------------------------------------------------- log-probs and entropy
def _scaled_fp32_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} (--rollout-temperature) must be > 0")
    logits = logits.float()
    # Out of place: ``.float()`` returns the caller's own tensor when it is already fp32.
    return logits if temperature == 1.0 else logits / temperature


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]`` in fp32; ``logits [..., V]``, ``labels [...]``.

    Uses ``gather − logsumexp`` so the full ``[..., V]`` log-softmax is never materialised.
    """
    logits = _scaled_fp32_logits(logits, temperature)
    picked = logits.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def head_log_probs_from_logits(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    labels: torch.Tensor,
    label_log_probs: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at several tokens per row (the trainer's log-probs of the sampler's
    top-k head, for score centering): ``logits [N, V]``, ``token_ids [N, k]`` → ``[N, k]`` fp32.

    Built on the row's label log-prob ``label_log_probs [N]`` (already computed, with grad, without keeping an fp32
    ``[N, V]`` temporary): ``log p_j = log p_y + (z_j − z_y) / T``, so the normaliser is not computed again."""
    head = logits.gather(-1, token_ids.long()).float()
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).float()
    return label_log_probs.unsqueeze(-1) + (head - picked) / temperature


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dim, in fp32: ``logsumexp(z) − Σ p·z``."""
    logits = _scaled_fp32_logits(logits, temperature)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# -------------------------------------------------------------------------------------------------- reduction
def reduce_token_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_lengths: list[int],
    calculate_per_token_loss: bool,
    global_num_samples: int,
    global_num_tokens: int,
    sample_denominators: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a packed micro-batch's per-token loss so that summing over micro-batches gives the global loss.

    ``per_token_loss``/``loss_mask`` are 1-D over the packed responses whose lengths are ``sample_lengths``.
    Default: each sample's masked token mean (a fully masked sample counts 0), summed, ``/ global_num_samples``
    (samples in the whole global batch). ``sample_denominators`` replaces each sample's own masked-token count
    (slime's per-trajectory mean: every sample of a trajectory divides by the trajectory's masked tokens, and
    ``global_num_samples`` counts trajectories). ``calculate_per_token_loss``: sum over masked tokens
    ``/ global_num_tokens`` (masked tokens in the whole global batch).
    """
    if per_token_loss.shape != loss_mask.shape or sum(sample_lengths) != per_token_loss.numel():
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} must be 1-D "
            f"of the same length sum(sample_lengths)={sum(sample_lengths)}"
        )
    mask = loss_mask.to(per_token_loss.dtype)
    masked_loss = per_token_loss * mask
    if calculate_per_token_loss:
        if global_num_tokens <= 0:
            raise ValueError(
                f"global_num_tokens={global_num_tokens} must be > 0 (no loss tokens in the batch)"
            )
        return masked_loss.sum() / global_num_tokens
    if global_num_samples <= 0:
        raise ValueError(f"global_num_samples={global_num_samples} must be > 0")
    # built on the host and copied without waiting: lengths on the GPU cost two stream syncs per micro-batch (the
    # copy, and repeat_interleave's output size)
    lengths = torch.tensor(sample_lengths)
    sample_ids = torch.repeat_interleave(torch.arange(len(sample_lengths)), lengths)
    sample_ids = sample_ids.to(per_token_loss.device, non_blocking=True)
    per_sample_sum = masked_loss.new_zeros(len(sample_lengths)).index_add(0, sample_ids, masked_loss)
    if sample_denominators is None:
        sample_denominators = mask.new_zeros(len(sample_lengths)).index_add(0, sample_ids, mask)
    denominators = sample_denominators.to(per_sample_sum).clamp(min=1)
    return (per_sample_sum / denominators).sum() / global_num_samples
