"""W2SPO (w2spo.py) on TRL 1.16: a rollout_func that builds the branches, TRL's loss on branch tokens only.

W2SPO changes what a group is: per prompt x one prefix rollout of the target, a branch point b
inside it, then G branches from the state s = x + prefix (B_t of the target, B_a of a frozen
auxiliary model), each continued by the target and rewarded; only the branch tokens are trained, the
auxiliary's weighed by min(pi_old / pi_aux, C). TRL can carry all of that through a `rollout_func`
(GRPOTrainer's argument), which returns for every row:

    prompt_ids      s = x + prefix                     (TRL conditions the row on it, trains none of it)
    completion_ids  the branch y_i + the continuation c_i
    env_mask        1 on the branch's tokens, 0 on the continuation's: TRL multiplies its loss mask by
                    it (`env_mask` becomes TRL's tool_mask, the mask of tool and environment tokens)
    logprobs        log pi_aux of an auxiliary branch's tokens, NaN elsewhere: TRL's importance-sampling
                    correction takes exp(log pi_old - logprobs) per token, exactly 1 where NaN
    w2spo_reward    r_i, read back by the reward function (TRL forwards extra fields to it)

The branches come from w2spo.py's own `sample_groups` (steps 1-5) and `score_aux_branches` (pi_aux),
imported as they are. The per-token weight is TRL's importance-sampling correction, set as the
README maps --aux-is: truncated -> vllm_importance_sampling_mode="token_truncate", branch ->
"sequence_truncate" (the product over the row's env_mask tokens), both with
vllm_importance_sampling_clip_max=C (--is-cap); none -> no correction. tests/test_engines.py checks
that TRL's weights equal w2spo.importance_weights.

What TRL cannot express (each refused here with a one-line error, and shown in tests/test_engines.py):
  * --aux-is clip (the ratio taken against pi_aux on auxiliary tokens only): TRL's pi_old is always its
    own forward pass over every completion token; nothing a rollout returns replaces it on some tokens.
  * --beta with auxiliary branches: w2spo.py weighs k3 by v = min(pi_old / pi_aux, C) on auxiliary
    tokens; TRL adds beta k3 after its correction, unweighted (or times pi_theta / pi_old).
  * TRL applies the correction only when it samples with vLLM itself (use_vllm=True, which starts its
    own engine at init). When the rollout samples with Hugging Face generate (--backend hf, the CPU
    default), W2SPOTrainer sets the flag after init, so that TRL's correction code runs as it is, and
    marks the (shared) weights as synced. With --backend vllm the target samples on TRL's engine.
A prompt without a branch point (its rollout too short) has no group in w2spo.py, but TRL needs
G rows for each of its prompts: it gets G rows of one masked token (A = 0), which train nothing.
TRL's "grpo" and "dr_grpo" losses (--loss-agg seq-mean, seq-sum-norm) divide by the rows, though:
each micro-batch by its own rows (b) and the accumulation steps, and the processes' gradients are
averaged, so one step divides by all P G rows, where w2spo.py divides by the K G rows of its kept
prompts. W2SPOTrainer counts, for each generation batch (one optimizer step's rows on a process),
the rows that have a branch, gathers both counts from every process, and multiplies each
micro-batch's loss by P G / (K G): the step's loss and gradient are then w2spo.py's, on any number
of processes and accumulation steps. --loss-agg token-mean ("dapo") divides by the trained tokens,
which the masked rows do not add to, so it needs no factor.
Both models' rows are forwarded whole, continuation included (w2spo.py forwards only s + y).

Run (CPU, a quick look):
    python tests/engines/trl_w2spo.py --steps 2 --prompts-per-step 2 --group-size 4
Run at scale:
    accelerate launch --multi_gpu --num_processes 8 tests/engines/trl_w2spo.py \\
        --model Qwen/Qwen3-4B --aux-model Qwen/Qwen3-0.6B-Base --dataset train.jsonl
"""
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import w2spo  # noqa: E402  (the method: imported, never copied)
import trl_grpo  # noqa: E402  (GRPO's settings, which W2SPO keeps)

IS_MODES = {"truncated": "token_truncate", "branch": "sequence_truncate"}  # --aux-is -> TRL's mode


def w2spo_config(args, output_dir, num_processes=1):
    """trl_grpo.py's GRPOConfig plus W2SPO's importance-sampling correction (--aux-is, --is-cap)."""
    if args.aux_is == "clip":
        w2spo.die("--aux-is clip has no TRL equivalent: TRL's pi_old is its own forward pass on every "
                  "token; nothing a rollout returns makes it pi_aux on the auxiliary's tokens")
    if args.beta > 0 and args.aux_branches:
        w2spo.die("--beta with auxiliary branches has no TRL equivalent: TRL does not weigh k3 by "
                  "min(pi_old / pi_aux, C) on the auxiliary's tokens")
    if args.dual_clip:
        w2spo.die("--dual-clip is not carried here (TRL's delta is close, not equal, at c <= 1 + eps_high)")
    correction = args.aux_is in IS_MODES
    # Dr. GRPO's constant: a W2SPO row trains at most --branch-len tokens (w2spo.py's normaliser)
    length = args.branch_len if args.loss_agg == "seq-sum-norm" else args.max_new_tokens
    return trl_grpo.grpo_config(args, output_dir, num_processes, max_completion_length=length,
                                vllm_importance_sampling_correction=correction,
                                vllm_importance_sampling_mode=IS_MODES.get(args.aux_is, "token_truncate"),
                                vllm_importance_sampling_clip_max=args.is_cap,
                                vllm_importance_sampling_clip_min=None)


class W2SPOTrainer(trl_grpo.GRPOTrainerSkippingEmptySteps):
    """GRPOTrainer whose importance-sampling correction also runs when the rollout samples without
    TRL's vLLM engine, and whose per-row normalisers count w2spo.py's rows, those with a branch
    (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_per_branch_row = 1.0  # P G / (K G) of the latest generation batch
        self.samples_itself = not self.args.use_vllm
        if self.samples_itself and self.args.vllm_importance_sampling_correction:
            self.use_vllm = True  # what TRL's correction reads; no engine was started at init

    def _generate(self, prompts):
        if self.samples_itself:  # no TRL engine: its weights are the policy's own
            self._last_loaded_step = self.state.global_step
        return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        trained = output["completion_mask"] * output["tool_mask"]  # [b, T]: the branches' tokens
        counts = torch.tensor([len(trained), (trained.sum(dim=1) > 0).sum().item()],
                              device=self.accelerator.device)  # (rows, rows with a branch)
        rows, branched = self.accelerator.gather(counts).view(-1, 2).sum(dim=0).tolist()
        self.rows_per_branch_row = rows / max(branched, 1)  # P G / (K G), over every process
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.loss_type in ("grpo", "dr_grpo"):  # per-row normalisers: w2spo.py's K G rows
            loss = loss * self.rows_per_branch_row
        return loss


class BranchRollout:
    """TRL's rollout_func: P x G conversations (each prompt G times in a row) -> one row per branch."""

    def __init__(self, args, tokenizer, aux_model, answers):
        self.args, self.tokenizer, self.aux_model = args, tokenizer, aux_model
        self.answers = answers  # question -> gold answer (TRL hands a rollout the prompts only)
        self.stats = []  # per call: score_aux_branches's measures and the step's token counts

    def samplers(self, trainer):
        """The target's sampler (TRL's vLLM engine where it has one) and the auxiliary's."""
        dtype = getattr(torch, self.args.dtype)
        if trainer.args.use_vllm:
            target = w2spo.Sampler("vllm", None, self.tokenizer, trainer.vllm_generation.llm, dtype)
        else:
            target = w2spo.Sampler("hf", trainer.accelerator.unwrap_model(trainer.model),
                                   self.tokenizer, None, dtype)
        return target, w2spo.Sampler("hf", self.aux_model, self.tokenizer, None, dtype, "--aux-model")

    def __call__(self, prompts, trainer):
        args, G = self.args, self.args.group_size
        if len(prompts) % G or any(prompts[i] != prompts[i - i % G] for i in range(len(prompts))):
            w2spo.die("W2SPO needs each prompt's G rows on one process: per_device_train_batch_size "
                      "x steps_per_generation must be a multiple of --group-size")
        questions = [prompt[-1]["content"] for prompt in prompts[::G]]
        problems = [{"question": q, "answer": self.answers[q]} for q in questions]
        xs = [w2spo.encode_prompt(self.tokenizer, q, args.system_prompt, args.chat_template_kwargs)
              for q in questions]  # x, as w2spo.py encodes it
        model = trainer.accelerator.unwrap_model(trainer.model)
        training = model.training  # the samplers switch to eval(); TRL reads .training afterwards
        target, aux = self.samplers(trainer)
        branches, counts = w2spo.sample_groups(target, aux, self.tokenizer, xs, problems, args)
        stats = w2spo.score_aux_branches(model, self.aux_model, branches, args)  # sets aux_logprobs
        model.train(training)
        self.stats.append({**stats, **counts})
        rows = {key: [] for key in ("prompt_ids", "completion_ids", "env_mask", "logprobs",
                                    "w2spo_reward", "by_aux")}
        groups = [branches[k: k + G] for k in range(0, len(branches), G)]  # the K kept prompts
        for x in xs:  # in the prompts' order; a group's state starts with its x
            group = groups.pop(0) if groups and groups[0][0].state[: len(x)] == x else None
            for branch in group or []:
                c = branch.continuation
                rows["prompt_ids"].append(branch.state)  # s = x + q[:b]
                rows["completion_ids"].append(branch.ids + c)  # y_i + c_i
                rows["env_mask"].append([1] * len(branch.ids) + [0] * len(c))  # train y_i only
                own = branch.aux_logprobs if branch.by_aux else [math.nan] * len(branch.ids)
                rows["logprobs"].append(own + [math.nan] * len(c))  # pi_aux; NaN: weight 1
                rows["w2spo_reward"].append(branch.reward)
                rows["by_aux"].append(branch.by_aux)
            if group is None:  # no branch point: G rows of one masked token, A = 0
                for _ in range(G):
                    rows["prompt_ids"].append(x)
                    rows["completion_ids"].append([self.tokenizer.eos_token_id])
                    rows["env_mask"].append([0])
                    rows["logprobs"].append([math.nan])
                    rows["w2spo_reward"].append(0.0)
                    rows["by_aux"].append(False)
        return rows


def branch_reward(completions, w2spo_reward, **_):
    """TRL's reward function: r_i as sample_groups scored it (q[:b] + y_i + c_i)."""
    return list(w2spo_reward)


def build_trainer(args, trainer_class=W2SPOTrainer):
    """The trainer and its rollout for w2spo.py's flags `args` (w2spo.parse_args)."""
    trl_grpo.refuse_unmapped(args, w2spo.parse_args([]))
    config = w2spo_config(args, args.output_dir, trl_grpo.num_processes())  # flags before models
    aux_model = w2spo.load_aux(args)  # frozen; another vocabulary is a one-line error
    model, tokenizer = trl_grpo.load_policy(args)
    aux_model.to(model.device, getattr(torch, args.dtype))
    dataset = trl_grpo.training_dataset(args)
    rollout = BranchRollout(args, tokenizer, aux_model,
                            {row["prompt"][-1]["content"]: row["answer"] for row in dataset})
    trainer = trainer_class(model=model, processing_class=tokenizer, reward_funcs=branch_reward,
                            train_dataset=dataset, rollout_func=rollout, args=config)
    return trainer, rollout


def main(argv=None):
    args = w2spo.parse_args(argv)  # also checks the flags and makes --output-dir
    trainer, rollout = build_trainer(args)
    trainer.train()
    if trainer.accelerator.is_main_process:
        print({"w2spo": rollout.stats[-1] if rollout.stats else {},
               "evaluation": trl_grpo.evaluate_after(trainer.accelerator.unwrap_model(trainer.model),
                                                     trainer.processing_class, args)})


if __name__ == "__main__":
    main()
