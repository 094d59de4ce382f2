"""Agreement of verifier.py with the labelled public cases, per tier.

    python tests/bench_verifier_cases.py [--verifier PATH] [--no-symbolic] [--failing]

Reads tests/verifier_cases/public_cases.jsonl (its README says where the cases come from) and
prints, per tier, the cases where the verifier agrees with the label (a case also fails when it
raises or takes 2 s or more), then the pairs labelled False that it calls True in either
argument order. --verifier loads another verifier.py (e.g. an older checkout's) for a
before/after table; --no-symbolic sets SYMBOLIC = False; --failing lists the failing ids."""
import argparse
import importlib.util
import json
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier", default=str(ROOT / "verifier.py"), help="verifier.py to load")
    parser.add_argument("--no-symbolic", action="store_true", help="set SYMBOLIC = False first")
    parser.add_argument("--failing", action="store_true", help="list the failing case ids")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("verifier_under_test", args.verifier)
    verifier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verifier)
    if args.no_symbolic:
        verifier.SYMBOLIC = False
    path = ROOT / "tests" / "verifier_cases" / "public_cases.jsonl"
    results, false_positives = defaultdict(list), []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        fn = getattr(verifier, case.get("fn") or {"equiv": "is_equiv", "reward": "reward"}[case["kind"]])
        first = case["pred"] if "pred" in case else case.get("completion")
        args_ = (first,) if fn is verifier.extract_answer else (first, case["gold"])
        start, got = time.perf_counter(), None
        try:
            got = fn(*args_)
            if fn is verifier.reward:
                got = got == 1.0
            ok = case["expected"] is None or got == case["expected"]
        except Exception:
            ok = False
        ok = ok and time.perf_counter() - start < 2.0
        results[case["tier"]].append((case["id"], ok))
        if case["expected"] is False:
            if got is True:
                false_positives.append(case["id"])
            if fn is verifier.is_equiv and verifier.is_equiv(case["gold"], first):
                false_positives.append(case["id"] + " (arguments swapped)")
    print(f"{args.verifier}{' (SYMBOLIC = False)' if args.no_symbolic else ''}")
    for tier, rows in sorted(results.items()):
        passed = sum(ok for _, ok in rows)
        print(f"  {tier:11s} {passed:4d}/{len(rows):<4d} {passed / len(rows):6.1%}")
        if args.failing and passed < len(rows):
            print("              failing: " + " ".join(i for i, ok in rows if not ok))
    print(f"  false positives (both argument orders): {', '.join(false_positives) or 'none'}")


if __name__ == "__main__":
    main()
