"""The Megatron backend on one CUDA GPU: log-probs vs transformers (dense, MoE), HF round trip, torch_dist
checkpoint, and one GRPO step against the FSDP2 backend. Run: see tests/gpu/README.md."""

from __future__ import annotations

import copy
import functools
import importlib.util
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

# (prompt length, response length) of 6 samples: 3 groups of 2
SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4)]
VOCAB = 61
KINDS = [
    "dense",
    "moe",
    "llama",
    "glm4_moe",
    "glm4_moe_qk_norm",
    "qwen2",
    "deepseek_v3",
]  # the models the log-prob and HF round-trip tests cover


def _save_random_init(path, model_cls, config, seed):
    """Save a random-init ``model_cls(config)`` in fp32, with its MoE routers spread out so routing matters."""
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():  # the default init leaves router logits near zero; spread them so routing matters
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)  # the router (dense MLPs have gate_proj, not gate)
            if gate is None:
                continue
            gate.weight.normal_(0, 0.5)
            if hasattr(gate, "e_score_correction_bias"):  # GLM-4.5: experts are chosen by sigmoid + this bias
                gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return path


def build_moe(path, seed=0):
    """A small random-init Qwen3-MoE saved as HF (4 experts, top-2, renormalised like Qwen3-30B-A3B)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512,
        rope_theta=1000000.0, dtype="float32",
    )  # fmt: skip
    return _save_random_init(path, Qwen3MoeForCausalLM, config, seed)


def build_llama(path, seed=0):
    """A small random-init Llama 3.1-style model (GQA, rope_theta 5e5 with llama3 RoPE scaling, untied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    return _save_random_init(path, LlamaForCausalLM, config, seed)


def build_glm4_moe(path, seed=0, qk_norm=False):
    """A small random-init GLM-4.5 (glm4_moe): first layer dense, then 4 experts top-2 + 1 shared expert, sigmoid
    router with expert bias, half the head dim rotated, qkv bias; no MTP layer. ``qk_norm``: per-head q/k
    RMSNorm, as in GLM-4.5 (355B); GLM-4.5-Air has none."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        partial_rotary_factor=0.5, attention_bias=True, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        use_qk_norm=qk_norm, tie_word_embeddings=False, num_nextn_predict_layers=0, max_position_embeddings=512,
        rope_theta=1000000.0, rms_norm_eps=1e-5, dtype="float32",
    )  # fmt: skip
    return _save_random_init(path, Glm4MoeForCausalLM, config, seed)


def build_dense(path, seed=0):
    from vime.tools.make_tiny_model import build_tiny_model

    return build_tiny_model(path, seed=seed, task=None)


def build_family(path, arch, seed=0, **shape):
    """``make_tiny_model --arch arch``: Qwen2.5 (q/k/v biases), DeepSeek-V3 (MLA with YaRN, a group-limited sigmoid
    router with expert bias, a shared expert, the first layer dense) ..."""
    from vime.tools.make_tiny_model import build_tiny_model

    return build_tiny_model(path, seed=seed, task=None, arch=arch, **shape)


def make_args(model_dir, *extra):
    from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config
    from vime.utils.arguments import parse_args

    flags = flags_to_argv(flags_from_hf_config(load_hf_config(model_dir)))
    return parse_args(
        [
            "--train-backend", "megatron", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--lr", "1e-2", "--weight-decay", "0", "--micro-batch-size", "3", "--transformer-impl", "local",
            *flags, *extra,
        ]
    )  # fmt: skip


def samples_for_test(vocab=VOCAB):
    from vime.utils.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, tokens=torch.randint(4, vocab, (p + r,), generator=g).tolist(), response_length=r,
               reward=float(i % 2), status=Status.COMPLETED)
        for i, (p, r) in enumerate(SHAPES)
    ]  # fmt: skip


def hf_log_probs(model_dir, samples, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens], device="cuda")).logits[0].float().cpu()
            positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
            out.append(torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])])
    return out


def mean_abs_diff(a, b):
    return float(torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)]).mean())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    builders = {
        "dense": build_dense,
        "moe": build_moe,
        "llama": build_llama,
        "glm4_moe": build_glm4_moe,
        "glm4_moe_qk_norm": functools.partial(build_glm4_moe, qk_norm=True),
        "qwen2": functools.partial(build_family, arch="qwen2"),
        "deepseek_v3": functools.partial(build_family, arch="deepseek_v3"),
    }
    return {kind: str(build(root / kind)) for kind, build in builders.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_log_probs_match_transformers(models, kind):
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    samples = samples_for_test()
    want = hf_log_probs(models[kind], samples)
    got = MegatronTrainer(make_args(models[kind])).compute_log_probs(samples)
    diff = mean_abs_diff(got, want)
    worst = max(float((x - y).abs().max()) for x, y in zip(got, want, strict=True))
    print(f"\n[{kind}] fp32 log-probs vs transformers: mean |diff| {diff:.3e}, max {worst:.3e}")
    assert diff < 1e-4  # nan fails too

    want_bf16 = hf_log_probs(models[kind], samples, torch.bfloat16)
    got_bf16 = MegatronTrainer(make_args(models[kind], "--bf16")).compute_log_probs(samples)
    print(
        f"[{kind}] bf16 log-probs: Megatron vs transformers-bf16 mean |diff| {mean_abs_diff(got_bf16, want_bf16):.3e}; "
        f"Megatron-bf16 vs fp32 reference {mean_abs_diff(got_bf16, want):.3e}; "
        f"transformers-bf16 vs fp32 reference {mean_abs_diff(want_bf16, want):.3e}"
    )
    assert mean_abs_diff(got_bf16, want) < 0.1


@pytest.mark.parametrize("kind", KINDS)
def test_hf_round_trip_is_bit_exact(models, kind, tmp_path):
    from safetensors.torch import load_file

    from vime.backends.megatron_utils.trainer import MegatronTrainer

    original = {}
    for f in sorted(__import__("pathlib").Path(models[kind]).glob("*.safetensors")):
        original.update(load_file(f))
    trainer = MegatronTrainer(make_args(models[kind]))
    exported = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 20) for n, t in b}
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    trainer.export_hf(str(tmp_path / "hf"))
    again = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[n], t) for n, t in original.items())
    print(f"\n[{kind}] HF -> Megatron -> HF: {len(original)} tensors bit-exact")


def _grpo_step(trainer, config, samples):
    from vime.utils.train_data import shape_rewards

    rewards = shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])
    metrics = trainer.train(0, samples, rewards)
    weights = {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    return metrics, weights


@pytest.mark.parametrize(
    "kind,precision", [("dense", "fp32-sgd"), ("dense", "bf16-adam"), ("deepseek_v3", "fp32-sgd")]
)
def test_grpo_step_matches_fsdp(models, kind, precision, tmp_path):
    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    extra = ["--optimizer", "sgd", "--lr", "0.1"] if precision == "fp32-sgd" else ["--bf16", "--lr", "1e-3"]
    # the expert bias is a routing statistic, not trained: Megatron would move it after each step, FSDP does not
    bias = ["--moe-router-bias-update-rate", "0"] if kind == "deepseek_v3" else []
    config = make_args(models[kind], *extra, *bias)
    samples = samples_for_test()
    before = {n: t.float().cpu() for b in MegatronTrainer(config).iter_weight_buckets(1 << 30) for n, t in b}
    mega_metrics, mega = _grpo_step(MegatronTrainer(config), config, samples)
    fsdp_config = copy.deepcopy(config)
    fsdp_config.train_backend = "fsdp"
    fsdp_metrics, fsdp = _grpo_step(FSDPTrainer(fsdp_config), fsdp_config, samples)
    assert all(math.isfinite(v) for v in mega_metrics.values()), mega_metrics
    keys = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"]
    print(
        f"\n[{kind} {precision}] "
        + ", ".join(f"{k}: megatron {mega_metrics[k]:.6g} fsdp {fsdp_metrics[k]:.6g}" for k in keys)
    )
    update = max(float((fsdp[n] - before[n]).abs().max()) for n in fsdp)
    weight_diff = max(float((mega[n] - fsdp[n]).abs().max()) for n in fsdp)
    print(
        f"[{kind} {precision}] largest weight update {update:.3e}; largest Megatron-vs-FSDP weight diff "
        f"{weight_diff:.3e}"
    )
    assert update > 0
    tol = 1e-5 if precision == "fp32-sgd" else 2e-2
    assert abs(mega_metrics["loss"] - fsdp_metrics["loss"]) < tol
    assert abs(mega_metrics["grad_norm"] - fsdp_metrics["grad_norm"]) < max(
        tol, 1e-3 * fsdp_metrics["grad_norm"]
    )
    for name in fsdp:
        if precision == "fp32-sgd":
            torch.testing.assert_close(mega[name], fsdp[name], atol=1e-5, rtol=1e-4, msg=name)
        else:  # both exported in bf16: at most a couple of bf16 ulps apart
            torch.testing.assert_close(mega[name], fsdp[name], atol=1e-2, rtol=1.6e-2, msg=name)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_critic_matches_fsdp(models, kind, tmp_path):
    """The Megatron critic (value head on the same GPTModel) starts from an FSDP critic's HF export and gives the
    same values and the same value-loss SGD step (fp32)."""
    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.utils.train_data import shape_rewards

    extra = ["--advantage-estimator", "ppo", "--optimizer", "sgd", "--lr", "0.1"]
    fsdp_config = make_args(models[kind], *extra)
    fsdp_config.train_backend = "fsdp"
    fsdp = FSDPTrainer(fsdp_config, role="critic")
    fsdp.export_hf(str(tmp_path / "critic"))  # a token classifier: score.weight/bias, no lm_head
    config = make_args(str(tmp_path / "critic"), *extra)
    mega = MegatronTrainer(config, role="critic")
    samples = samples_for_test()
    want, got = fsdp.compute_values(samples), mega.compute_values(samples)
    diff = mean_abs_diff(got, want)
    print(f"\n[{kind} critic] fp32 values vs FSDP critic: mean |diff| {diff:.3e}")
    assert diff < 1e-5

    rewards = shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])
    mega_metrics = mega.train(0, samples, rewards, values=got)
    fsdp_metrics = fsdp.train(0, samples, rewards, values=want)
    after = {n: t.float().cpu() for b in mega.iter_weight_buckets(1 << 30) for n, t in b}
    reference = {n: t.float().cpu() for b in fsdp.iter_weight_buckets(1 << 30) for n, t in b}
    shared = sorted(set(after) & set(reference))
    assert "score.weight" in shared and "score.bias" in shared
    weight_diff = max(float((after[n] - reference[n]).abs().max()) for n in shared)
    print(
        f"[{kind} critic] value loss megatron {mega_metrics['value_loss']:.6g} fsdp {fsdp_metrics['value_loss']:.6g}; "
        f"grad norm {mega_metrics['grad_norm']:.6g} vs {fsdp_metrics['grad_norm']:.6g}; "
        f"largest weight diff after one SGD step {weight_diff:.3e} over {len(shared)} tensors"
    )
    assert abs(mega_metrics["value_loss"] - fsdp_metrics["value_loss"]) < 1e-5
    assert abs(mega_metrics["grad_norm"] - fsdp_metrics["grad_norm"]) < 1e-3 * fsdp_metrics["grad_norm"]
    for name in shared:
        torch.testing.assert_close(after[name], reference[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
def test_torch_dist_checkpoint_round_trip(models, tmp_path, optimizer):
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    save = str(tmp_path / "ckpt")
    extra = ["--use-distributed-optimizer"] if optimizer == "distributed" else []
    config = make_args(models["moe"], "--bf16", *extra, "--save", save, "--lr", "1e-3")
    samples = samples_for_test()
    trainer = MegatronTrainer(config)
    _grpo_step(trainer, config, samples)
    trainer.save(3, save)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    want = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    metrics_next = trainer.train(1, samples, [1.0, -1.0] * 3)

    resumed_config = copy.deepcopy(config)
    resumed_config.load = save
    resumed = MegatronTrainer(resumed_config)
    assert resumed.load() == 3 and resumed.step == 1
    got = {n: t.cpu() for b in resumed.iter_weight_buckets(1 << 30) for n, t in b}
    assert all(torch.equal(got[n], want[n]) for n in want)
    resumed_next = resumed.train(1, samples, [1.0, -1.0] * 3)  # optimizer state restored -> same next step
    assert abs(resumed_next["loss"] - metrics_next["loss"]) < 1e-6
    after_a = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    after_b = {n: t.cpu() for b in resumed.iter_weight_buckets(1 << 30) for n, t in b}
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)
    print(f"\n[torch_dist, {optimizer} optimizer] save -> load -> next step bit-identical")


def test_convert_tools_round_trip(models, tmp_path):
    from safetensors.torch import load_file

    from vime.backends.megatron_utils.convert import hf_to_torch_dist, torch_dist_to_hf

    source = models["moe"]
    hf_to_torch_dist(["--hf-checkpoint", source, "--save", str(tmp_path / "dist")])
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "0"
    torch_dist_to_hf(
        ["--hf-checkpoint", source, "--load", str(tmp_path / "dist"), "--output-dir", str(tmp_path / "hf"),
         "--dtype", "float32"]
    )  # fmt: skip
    original, again = (
        load_file(f"{source}/model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[n], t) for n, t in original.items())
    print(f"\n[convert tools] HF -> torch_dist -> HF: {len(original)} tensors bit-exact")


def test_grouped_gemm_experts_match_the_sequential_loop(models):
    """``--moe-grouped-gemm`` (vime's stacked expert weights, torch grouped GEMMs) computes what Megatron's per-expert
    loop does: the same bf16 log-probs up to rounding and, through Megatron's DDP over two micro-batches, the same
    expert main_grads (cosine similarity, overall and per expert; zero where an expert got no tokens), and one Adam
    step lands on the same weights within bf16 rounding. Each projection of a layer's experts is one parameter, its
    weight gradient added into main_grad by one ``add_`` (not DDP's per-parameter hook).
    Also run tests/unit/test_grouped_linear.py here (its CUDA cases):
    bash tests/gpu/run.sh tests/gpu/test_megatron_gpu.py tests/unit/test_grouped_linear.py -k grouped"""
    from torch.profiler import ProfilerActivity, profile

    from vime.backends.megatron_utils.grouped_experts import GroupedGemmExperts, per_expert
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    samples = samples_for_test()
    results = {}
    for grouped in (False, True):
        config = make_args(
            models["moe"], "--bf16", "--lr", "1e-3", *(["--moe-grouped-gemm"] if grouped else [])
        )
        trainer = MegatronTrainer(config)
        experts = [m for m in trainer.module.modules() if isinstance(m, GroupedGemmExperts)]
        assert bool(experts) == grouped
        assert all(len(list(m.parameters())) == 2 for m in experts)  # one stacked weight per projection
        log_probs = trainer.compute_log_probs(samples)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train(0, samples, [1.0, -1.0] * 3, log_probs=log_probs)
        ops = {e.key: e.count for e in prof.key_averages()}
        grads = {
            n: g.float().clone()
            for name, p in trainer.module.named_parameters()
            if ".experts." in name
            for n, g in per_expert(name, p.main_grad)
        }
        after = {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
        results[grouped] = (torch.cat(log_probs), grads, ops, after)
        del trainer
        torch.cuda.empty_cache()
    (lp_loop, g_loop, ops_loop, w_loop), (lp_grouped, g_grouped, ops_grouped, w_grouped) = (
        results[False],
        results[True],
    )
    assert float((lp_loop - lp_grouped).abs().mean()) < 1e-2
    names = sorted(g_loop)
    assert names == sorted(g_grouped) and names
    flat_loop = torch.cat([g_loop[n].flatten() for n in names])
    assert float(flat_loop.norm()) > 0
    cosine = _cosine(flat_loop, torch.cat([g_grouped[n].flatten() for n in names]))
    adds = (ops_loop.get("aten::add_", 0), ops_grouped.get("aten::add_", 0))
    weight_diff = max(float((w_loop[n] - w_grouped[n]).abs().max()) for n in w_loop)
    print(
        f"\n[grouped GEMM experts] log-prob diff {float((lp_loop - lp_grouped).abs().mean()):.2e}, grad cos {cosine:.5f}"
        f", aten::add_ in train {adds[0]} (loop) vs {adds[1]} (grouped), largest weight diff after a step "
        f"{weight_diff:.3e}"
    )
    assert cosine > 0.99
    for n in names:
        if float(g_loop[n].norm()) == 0:  # an expert without tokens in both micro-batches
            assert float(g_grouped[n].norm()) == 0, n
        else:
            assert _cosine(g_loop[n].flatten(), g_grouped[n].flatten()) > 0.95, n
    # on the loop path DDP's hook adds each expert weight's gradient into main_grad (per micro-batch); grouped:
    # one add per projection and layer
    assert adds[0] - adds[1] >= len(names), adds
    assert sorted(w_grouped) == sorted(w_loop)
    for n in w_loop:  # both exported in bf16: at most a couple of bf16 ulps (or a flipped Adam sign) apart
        torch.testing.assert_close(w_grouped[n], w_loop[n], atol=1e-2, rtol=1.6e-2, msg=n)


def test_grouped_gemm_experts_round_trip_hf_and_match_transformers(models, tmp_path):
    """With ``--moe-grouped-gemm`` (stacked expert weights) HF -> Megatron -> HF stays bit-exact, by the weight
    buckets (per expert and stacked for vLLM) and by the HF export, and the log-probs match transformers: fp32 (the
    per-expert loop over the stacked weights) and bf16 (grouped GEMMs)."""
    from safetensors.torch import load_file

    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.utils.stacked_experts import expand_stacked, parse_stacked

    source = models["moe"]
    original = load_file(f"{source}/model.safetensors")
    trainer = MegatronTrainer(make_args(source, "--moe-grouped-gemm"))
    exported = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 20) for n, t in b}
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    stacked = [  # a stacked entry is a StackedTensor of the per-expert views, stacked when it is sent
        (n, (t if isinstance(t, torch.Tensor) else torch.stack(t.parts)).cpu())
        for b in trainer.iter_weight_buckets(1 << 30, stack_experts=True)
        for n, t in b
    ]
    assert (
        sum(parse_stacked(n) is not None for n, _ in stacked) == 2 * 2
    )  # w13 and w2 of each of the 2 layers
    assert dict(expand_stacked(stacked)).keys() == original.keys()
    assert all(torch.equal(t, original[n]) for n, t in expand_stacked(stacked))
    trainer.export_hf(str(tmp_path / "hf"))
    again = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(again) == sorted(original) and all(torch.equal(again[n], t) for n, t in original.items())

    samples = samples_for_test()
    want = hf_log_probs(source, samples)
    diff = mean_abs_diff(trainer.compute_log_probs(samples), want)
    del trainer
    diff_bf16 = mean_abs_diff(
        MegatronTrainer(make_args(source, "--bf16", "--moe-grouped-gemm")).compute_log_probs(samples), want
    )
    print(
        f"\n[grouped GEMM experts] HF round trip bit-exact; log-probs vs transformers fp32 {diff:.3e}, bf16 {diff_bf16:.3e}"
    )
    assert diff < 1e-4
    assert diff_bf16 < 0.1


@pytest.mark.parametrize("saved_grouped", [False, True])
def test_grouped_gemm_torch_dist_checkpoint_loads_across_expert_layouts(models, tmp_path, saved_grouped):
    """A ``torch_dist`` checkpoint (model and plain optimizer) saved with per-expert weights loads into stacked ones
    and the other way round: the same weights bit for bit, and the next step as the saving trainer takes it."""
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    save = str(tmp_path / "ckpt")
    flags = {True: ["--moe-grouped-gemm"], False: []}
    config = make_args(models["moe"], "--bf16", "--save", save, "--lr", "1e-3", *flags[saved_grouped])
    samples = samples_for_test()
    trainer = MegatronTrainer(config)
    _grpo_step(trainer, config, samples)
    trainer.save(3, save)
    want = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    metrics_next = trainer.train(1, samples, [1.0, -1.0] * 3)
    after_saver = {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    del trainer

    other = make_args(models["moe"], "--bf16", "--lr", "1e-3", *flags[not saved_grouped])
    other.load = save
    resumed = MegatronTrainer(other)
    assert resumed.load() == 3
    got = {n: t.cpu() for b in resumed.iter_weight_buckets(1 << 30) for n, t in b}
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    resumed_next = resumed.train(1, samples, [1.0, -1.0] * 3)
    after_resumed = {n: t.float().cpu() for b in resumed.iter_weight_buckets(1 << 30) for n, t in b}
    print(
        f"\n[grouped GEMM experts, saved {'stacked' if saved_grouped else 'per expert'}] next loss "
        f"{metrics_next['loss']:.6g} vs {resumed_next['loss']:.6g}"
    )
    assert abs(resumed_next["loss"] - metrics_next["loss"]) < 1e-2
    for n in after_saver:  # the optimizer state came along: the same Adam step up to bf16 rounding
        torch.testing.assert_close(after_resumed[n], after_saver[n], atol=1e-2, rtol=1.6e-2, msg=n)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


_PROVIDER = {"args": None, "calls": 0}


def recording_provider(pre_process, post_process, vp_stage=None):
    """--custom-model-provider-path in slime's signature: vime's own builder, counted."""
    from vime.backends.megatron_utils.model import build_gpt_model

    _PROVIDER["calls"] += 1
    return build_gpt_model(_PROVIDER["args"], VOCAB)


def test_slime_megatron_flags_keep_the_log_probs_and_the_update(models):
    """--custom-model-provider-path, --padded-vocab-size, --data-pad-size-multiplier, --log-probs-chunk-size and
    --recompute-loss-function change how the model is built and the loss computed, not the numbers."""
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    samples = samples_for_test()
    config = make_args(models["dense"], "--optimizer", "sgd", "--lr", "0.1")
    plain = MegatronTrainer(config)
    base = plain.compute_log_probs(samples)
    base_metrics, base_weights = _grpo_step(plain, config, samples)
    flags = ["--custom-model-provider-path", f"{__name__}.recording_provider", "--padded-vocab-size", "64",
             "--data-pad-size-multiplier", "16", "--log-probs-chunk-size", "3", "--recompute-loss-function"]  # fmt: skip
    args = make_args(models["dense"], "--optimizer", "sgd", "--lr", "0.1", *flags)
    _PROVIDER["args"] = args
    trainer = MegatronTrainer(args)
    assert _PROVIDER["calls"] >= 1
    assert trainer.module.embedding.word_embeddings.weight.shape[0] == 64  # not the default 128
    assert mean_abs_diff(trainer.compute_log_probs(samples), base) < 1e-5
    metrics, weights = _grpo_step(trainer, args, samples)
    assert abs(metrics["loss"] - base_metrics["loss"]) < 1e-5
    for name, tensor in base_weights.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
