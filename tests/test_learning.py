"""Learning, for real: the default runs (no flags: SmolLM2-135M-Instruct on the built-in
arithmetic task, on the CPU) measurably learn. Slow (about 8 minutes each on 2 cores); this is
the same run as `python grpo.py` / `python passk.py` with only the output folder changed."""
import grpo
import passk


def test_grpo_default_run_rises_40_points(tmp_path):
    summary = grpo.main(["--output-dir", str(tmp_path)])
    print({k: v for k, v in summary.items() if k != "args"})
    # the task is tuned so the base model starts low but not at zero
    assert 0.05 <= summary["pass@1_before"] <= 0.35, summary["pass@1_before"]
    assert summary["pass@1_after"] - summary["pass@1_before"] >= 0.40, summary


def test_passk_default_run_raises_pass_at_k(tmp_path):
    summary = passk.main(["--output-dir", str(tmp_path)])
    print({k: v for k, v in summary.items() if k != "args"})
    assert summary["k"] == 4 and summary["train_k"] == 4
    assert summary["pass@k_after"] - summary["pass@k_before"] >= 0.15, summary
