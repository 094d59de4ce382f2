"""The GPU path, for a machine with CUDA: `python -m pytest tests/ -m cuda` (skipped without CUDA;
CI never needs it). One step of every trainer with the tiny test model in bf16 compute with fp32
master weights, a run's summary that reports its own GPU peak, a resume that restores the CUDA
random states, and the measured peak memory of a training step against the rule of
tests/gpu_memory_estimate.py. No vLLM, no network, no files but the repository's."""
import gc
import json

import pytest
import torch

import grpo
import passk
import sampling_evolve
import w2spo
from gpu_memory_estimate import peak_bytes_per_parameter, training_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TRAINERS = {"grpo": grpo, "passk": passk, "w2spo": w2spo, "sampling_evolve": sampling_evolve}


def tiny_flags(model_dir, out, *extra):
    return ["--model", model_dir, "--prompts-per-step", "2", "--group-size", "4",
            "--micro-batch", "4", "--max-new-tokens", "12", "--eval-problems", "2",
            "--eval-samples", "2", "--eval-k", "1", "--lr", "1e-3", "--output-dir", str(out), *extra]


def collect_garbage():
    """Free what earlier tests left in reference cycles (models, optimizers), so that it neither
    counts in what a test measures nor is freed in the middle of its measurement."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("script", sorted(TRAINERS))
def test_one_step_of_every_trainer_on_cuda(script, tiny_model_dir, tmp_path):
    collect_garbage()
    summary = TRAINERS[script].main(tiny_flags(tiny_model_dir, tmp_path, "--steps", "1"))
    assert summary["compute_dtype"] == "bfloat16"  # --dtype auto on a GPU
    assert 0 < summary["peak_gpu_memory_gb"] < 2
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record.get("skipped_nonfinite", 0) == 0
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}  # master weights


def test_a_runs_summary_reports_its_own_gpu_peak(tiny_model_dir, tmp_path):
    """An earlier, heavier use of the GPU in the same process (here 3 GiB, freed before the run)
    is not the run's peak: Run resets the peak when it starts."""
    collect_garbage()
    heavy = torch.ones(3 * 2**30, dtype=torch.uint8, device="cuda")
    del heavy
    summary = grpo.main(tiny_flags(tiny_model_dir, tmp_path, "--steps", "1"))
    assert 0 < summary["peak_gpu_memory_gb"] < 2


def test_resume_on_cuda_restores_the_cuda_random_states(tiny_model_dir, tmp_path):
    whole = tmp_path / "whole"
    grpo.main(tiny_flags(tiny_model_dir, whole, "--steps", "2"))
    cut = tmp_path / "cut"
    grpo.main(tiny_flags(tiny_model_dir, cut, "--steps", "1", "--save-every", "1"))
    saved = torch.load(cut / "resume.pt", weights_only=False)
    assert len(saved["rng"][3]) == torch.cuda.device_count()  # every CUDA generator's state
    grpo.main(tiny_flags(tiny_model_dir, cut, "--steps", "2", "--resume"))
    records = [[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
               for folder in (whole, cut)]
    assert [r["step"] for r in records[1]] == [1, 2]
    for key in ("reward_mean", "completion_len_mean", "truncated_frac"):  # the same samples
        assert records[0][1][key] == records[1][1][key], key


def random_model(device):
    """A random Llama of about 40M parameters: large enough that weights and optimizer state,
    not activations, make the peak."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device)


def allocated_after_a_warm_up():
    """torch.cuda.memory_allocated() after one forward and backward of small layers, in bf16 and
    fp32, with and without a bias. cuBLAS (and cuBLASLt) allocate a workspace through torch's
    caching allocator the first time each handle and stream runs a matmul: the forward's on this
    thread, the backward's on autograd's. Counting from here leaves those one-off workspaces out
    of the bytes per parameter, which they would otherwise inflate on a small model."""
    for bias in (True, False):
        for dtype in (torch.bfloat16, torch.float32):
            layer = torch.nn.Linear(256, 256, bias=bias, device="cuda")
            inputs = torch.randn(16, 256, device="cuda", requires_grad=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                layer(inputs).sum().backward()
            del layer, inputs
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("fused", [True, False])
def test_peak_memory_of_a_step_follows_the_rule(fused):
    cpu_peak, split = peak_bytes_per_parameter(random_model("cpu"), fused)  # the rule, profiled
    collect_garbage()
    baseline = allocated_after_a_warm_up()  # bytes that belong to no model
    model = random_model("cuda")
    count = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused, foreach=not fused)
    batch = [t.cuda() for t in grpo.build_batch([[1, 2, 3, 4]] * 2, [[5, 6, 7, 8]] * 2, 0)]
    training_step(model, optimizer, batch, torch.bfloat16)  # the moments exist from now on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    training_step(model, optimizer, batch, torch.bfloat16)
    torch.cuda.synchronize()
    cuda_peak = (torch.cuda.max_memory_allocated() - baseline) / count
    resident = (torch.cuda.memory_allocated() - baseline) / count  # weights, moments; no gradient
    print(f"fused={fused}: peak bytes per parameter, CUDA {cuda_peak:.2f}, CPU profile "
          f"{cpu_peak:.2f} ({split}); resident after the step {resident:.2f}")
    assert 11.5 < resident < 12.5
    assert abs(cuda_peak - cpu_peak) < 1.5, (cuda_peak, cpu_peak)
