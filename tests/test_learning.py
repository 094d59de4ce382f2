"""Learning, for real: the default runs (SmolLM2-135M-Instruct on the built-in arithmetic task, on
the CPU), shortened to 6 steps and evaluated on 16 held-out problems x 4 samples so that CI stays
within its budget, measurably learn. `python tests/run_defaults.py` makes the full runs whose
numbers the README gives; the thresholds here sit well below what this schedule measured."""
import grpo
import passk

SHORT = ["--steps", "6", "--eval-problems", "16", "--eval-samples", "4"]


def test_grpo_default_run_rises(tmp_path):
    summary = grpo.main(["--output-dir", str(tmp_path), *SHORT])
    print({k: v for k, v in summary.items() if k != "args"})
    # the task is tuned so the base model starts low but not at zero
    assert 0.05 <= summary["pass@1_before"] <= 0.35, summary["pass@1_before"]
    assert summary["pass@1_after"] - summary["pass@1_before"] >= 0.20, summary


def test_passk_default_run_raises_pass_at_k(tmp_path):
    summary = passk.main(["--output-dir", str(tmp_path), *SHORT])
    print({k: v for k, v in summary.items() if k != "args"})
    assert summary["k"] == 4 and summary["train_k"] == 4
    assert summary["pass@k_after"] - summary["pass@k_before"] >= 0.10, summary
