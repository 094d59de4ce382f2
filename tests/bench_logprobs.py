"""Benchmark: the log-prob step of the update, three ways side by side in one run, and the peak
memory of one training step end to end.

    python tests/bench_logprobs.py                       # all of it (about an hour on 2 cores)
    python tests/bench_logprobs.py --tokens 512 --repeats 1 --skip-end-to-end   # a quick look

The three ways, on the same model, rows and completion lengths:
  before  token_logprobs before the chunks (kept in tests/test_logprobs.py as the reference): the
          model's logits of the completion [b, T, V], then logit - logsumexp in fp32, row by row
  chunks  token_logprobs now (grpo.py's plumbing): the body, then the head and the log-softmax
          LOGIT_CHUNK tokens at a time, recomputed in the backward pass
  TRL     the model's logits of the completion, then trl.trainer.utils.selective_log_softmax (its
          pure-torch path; its Triton kernel needs a GPU)
The model: SmolLM2-135M-Instruct (the offline default; vocabulary 49,152) and the same model with
its embedding (tied: the output layer too) grown to 152,064 rows (the vocabulary of Qwen2.5-7B and
DeepSeek-R1-Distill-Qwen), one row of a 16-token prompt and T completion tokens, temperature 0.7.

1. End to end (the issue's measurement): the growth of peak resident memory over one
   grpo.train_step with --beta 0.01 (every row forwarded, a reference model too) on a 2-layer
   Llama of width 64 with a 152,064 vocabulary, 2 rows of T new tokens, each (way, T) in a fresh
   process (run first: a child process starts with its parent's peak); per extra completion token.
2. Memory kept for the backward pass, per completion token: the bytes of every tensor the autograd
   graph saves (torch.autograd.graph.saved_tensors_hooks, each storage once, the weights left
   out), less what the model's body alone keeps (the same for all three): what the log-prob step
   adds.
3. Time of forward + backward, best of --repeats, the three interleaved (the machine's load falls
   on all three); and the same for the head and the log-softmax alone, from the body's hidden
   states (the part that changed). No entropy: TRL's function has none.
"""
import argparse
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
from test_logprobs import body_only, reference_token_logprobs  # noqa: E402

QWEN_VOCAB = 152064
WAYS = ("before", "chunks", "TRL")


def trl_token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch,
                       with_entropy=False, compute_dtype=torch.float32):
    """The model's logits of the completion, then TRL's selective_log_softmax (no entropy)."""
    from trl.trainer.utils import selective_log_softmax
    T = num_completion_tokens
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with grpo.autocast(model.device.type, compute_dtype):
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=T + 1).logits[:, :-1]  # [b, T, V]
    return selective_log_softmax(logits, ids[:, -T:], temperature), None


STEP = {"before": reference_token_logprobs, "chunks": grpo.token_logprobs,
        "TRL": trl_token_logprobs}


def model_with_vocabulary(vocab):
    """SmolLM2-135M-Instruct, its (tied) embedding grown to `vocab` rows by random ones."""
    model, _ = grpo.load_model("smollm2-135m", torch.float32, "cpu")
    if vocab != model.config.vocab_size:
        torch.manual_seed(0)
        model.resize_token_embeddings(vocab, mean_resizing=False)
    return model.train()


def one_row(vocab, T, prompt=16):
    """(ids, attention, mask) of one prompt of 16 tokens and T completion tokens, random ids."""
    generator = torch.Generator().manual_seed(T)
    ids = torch.randint(0, vocab, (1, prompt + T), generator=generator)
    return ids, torch.ones_like(ids), torch.ones(1, T, dtype=torch.long)


def kept_bytes(fn, model, batch, dtype):
    """Bytes the autograd graph saves for the backward pass of fn's log-probs (each storage once),
    the model's own weights left out: they are kept whatever the length."""
    ids, attention, mask = batch
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor.detach()  # the tensor itself: a reference cycle, never freed
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(model, ids, attention, mask.shape[1], 0.7, 1, False, dtype)
    return sum(storages.values())


def step_seconds(fn, model, batch, dtype):
    ids, attention, mask = batch
    start = time.perf_counter()
    logp, _ = fn(model, ids, attention, mask.shape[1], 0.7, 1, False, dtype)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def head_seconds(way, model, hidden, targets, dtype):
    """Forward + backward of the head and the log-softmax alone, from hidden states [1, T, d]."""
    from trl.trainer.utils import selective_log_softmax
    hidden = hidden.detach().requires_grad_()
    start = time.perf_counter()
    if way == "chunks":
        logp = grpo.hidden_logprobs(model, hidden, targets, 0.7, False, dtype)[0]
    else:
        with grpo.autocast("cpu", dtype):
            logits = model.get_output_embeddings()(hidden)  # [1, T, V]
        if way == "TRL":
            logp = selective_log_softmax(logits, targets, 0.7)
        else:  # before: row by row, fp32
            scaled = logits[0].float() / 0.7
            logp = scaled.gather(-1, targets[0, :, None]).squeeze(-1) - torch.logsumexp(scaled, -1)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def log_prob_step(args):
    dtype = getattr(torch, args.dtype)
    print(f"\n2-3. the log-prob step, SmolLM2-135M (30 layers, width 576), 1 row, {args.dtype}, "
          f"best of {args.repeats}; memory kept per completion token beyond the body's")
    print(f"{'V':>7} {'T':>5} | {'MB kept per token':^29} | {'seconds, body + head':^26} | "
          f"{'seconds, head alone':^26}")
    print(f"{'':>13} | {'before':>9} {'chunks':>9} {'TRL':>9} | {'before':>8} {'chunks':>8} "
          f"{'TRL':>8} | {'before':>8} {'chunks':>8} {'TRL':>8} | chunks/before, TRL/before")
    for vocab in args.vocab:
        model = model_with_vocabulary(vocab)
        for T in args.tokens:
            batch = one_row(vocab, T)
            body = kept_bytes(body_only, model, batch, dtype)
            kept = {way: (kept_bytes(STEP[way], model, batch, dtype) - body) / T / 1e6
                    for way in WAYS}
            steps, heads = {w: [] for w in WAYS}, {w: [] for w in WAYS}
            with torch.no_grad(), grpo.autocast("cpu", dtype):  # the body's states [1, T, d]
                hidden = model.base_model(input_ids=batch[0]).last_hidden_state[:, -T - 1:-1]
            for way in WAYS:  # a first, untimed step of each: allocations, kernels chosen
                step_seconds(STEP[way], model, batch, dtype)
            for _ in range(args.repeats):  # interleaved: the machine's load falls on all three
                for way in WAYS:
                    steps[way].append(step_seconds(STEP[way], model, batch, dtype))
                    heads[way].append(head_seconds(way, model, hidden, batch[0][:, -T:], dtype))
            s = {w: min(v) for w, v in steps.items()}
            h = {w: min(v) for w, v in heads.items()}
            print(f"{vocab:>7} {T:>5} | {kept['before']:>9.3f} {kept['chunks']:>9.3f} "
                  f"{kept['TRL']:>9.3f} | {s['before']:>8.2f} {s['chunks']:>8.2f} {s['TRL']:>8.2f} "
                  f"| {h['before']:>8.2f} {h['chunks']:>8.2f} {h['TRL']:>8.2f} | step "
                  f"{s['chunks'] / s['before']:.2f}x, {s['TRL'] / s['before']:.2f}x; head "
                  f"{h['chunks'] / h['before']:.2f}x, {h['TRL'] / h['before']:.2f}x", flush=True)


def train_step_peak(way, T, queue):
    """In a fresh process: the growth of peak RSS over one train_step of 2 rows of T new tokens
    (what does not grow with T, the AdamW moments among it, cancels between two lengths)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if way == "before":
        grpo.token_logprobs = reference_token_logprobs  # what train_step calls
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    model, ref_model = LlamaForCausalLM(config), LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    args = grpo.parse_args(["--beta", "0.01", "--micro-batch", "2", "--prompts-per-step", "1",
                            "--group-size", "2", "--max-new-tokens", str(T)])
    ids = torch.randint(3, QWEN_VOCAB, (2, 16 + T)).tolist()
    batch = {"prompts": [row[:16] for row in ids], "samples": [{"ids": row[16:]} for row in ids],
             "advantages": torch.tensor([1.0, -1.0])}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # a high-water mark: the step's
    grpo.train_step(model, optimizer, batch, args, ref_model)  # own peak, AdamW's moments too
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)


def end_to_end(args):
    print(f"1. one grpo.train_step (--beta 0.01), 2-layer Llama of width 64, V = {QWEN_VOCAB:,}, "
          "2 rows; growth of peak RSS over the step, each in a fresh process:")
    context = multiprocessing.get_context("spawn")
    peaks = {}
    for way, lengths in (("before", args.before_lengths), ("chunks", args.chunk_lengths)):
        for T in lengths:
            queue = context.Queue()
            worker = context.Process(target=train_step_peak, args=(way, T, queue))
            worker.start()
            peaks[way, T] = queue.get()
            worker.join()
            print(f"  {way:>6}, T = {T:>5}: {peaks[way, T] / 2**30:6.2f} GiB", flush=True)
    for way, lengths in (("before", args.before_lengths), ("chunks", args.chunk_lengths)):
        for short, long in zip(lengths, lengths[1:]):
            per_token = (peaks[way, long] - peaks[way, short]) / (2 * (long - short)) / 1e6
            print(f"  {way:>6}: {per_token:.3f} MB of peak per completion token from T = {short} "
                  f"to {long}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, QWEN_VOCAB])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before-lengths", type=int, nargs="+", default=[16, 480])
    parser.add_argument("--chunk-lengths", type=int, nargs="+", default=[16, 480, 2048, 4096])
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # glibc: blocks of 1 MiB and more are mapped,
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**20)  # and returned when freed; its heap
        os.execv(sys.executable, [sys.executable, *sys.argv])  # would keep them resident
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, LOGIT_CHUNK "
          f"{grpo.LOGIT_CHUNK}")
    if not args.skip_end_to_end:  # first: a child process starts with its parent's peak RSS
        end_to_end(args)
    if not args.skip_step:
        log_prob_step(args)


if __name__ == "__main__":
    main()
