"""Run sections: the mesh, the batch contract, optimizer, loop, launch (data: `config.data`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxmllm.config.checks import check, positive
from jaxmllm.config.data import (  # noqa: F401  (the data section, named here too)
    DATA_SOURCES,
    FORMATS,
    DataConfig,
    EvalConfig,
    SourceConfig,
    SyntheticConfig,
    files_format,
)
from jaxmllm.config.phases import ENCODERS, NAMES

# The planners `batch.planner` may name; `jaxmllm.plan.registry.PLANNERS` implements each (a test
# holds the two lists equal: config sits below the planners and names them only).
PLANNER_NAMES = ("orchestrated", "balanced", "grain", "naive", "first_fit")

# The batch sizes -1 leaves to the data (resolved at start-up, kept with the checkpoints)
AUTO_SIZES = (
    "route_pair_capacity",
    "llm_tiles",
    *(p.tiles for p in ENCODERS),
    "llm_documents",
    *(p.documents for p in ENCODERS),
    "devices_per_host",
)
# ... and the lists [-1] leaves to the data (the long variants' tiles, `BatchConfig`)
AUTO_LADDERS = ("llm_long_tiles", *(p.long_tiles for p in ENCODERS))
LONG_VARIANTS = 6  # most long variants of a step (`jaxmllm.plan.ladder.MAX_VARIANTS` - 1)


# XLA:CPU makes any number of virtual devices, each with its own threads and buffers: 100,000
# crashed it after 90 s. A process may split its cores into at most this many devices each
# (`jaxmllm.process.distributed.split_cpu` checks it against the machine), 256 at least.
MAX_CPU_DEVICES_PER_CORE = 32

# mesh.context_strategy's values (`jaxmllm.models.context`)
CONTEXT_STRATEGIES = ("gather", "ulysses")
# mesh.context_steps' values: which steps split their LLM rows over the context groups
CONTEXT_STEPS = ("all", "long", "auto")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh. Axis sizes multiply to the device count; -1 takes the remaining devices."""

    data: int = -1  # pure data parallelism (replicated params); slowest axis, spans hosts
    stage: int = 1  # pipeline stages: the stacked layers split into stages (see `pipeline`)
    # Expert parallelism: the decoder's routed experts (model.llm.moe) split over this many
    # devices, which also hold data-parallel buckets (EP inside DP: the batch is split over it
    # as over data); tokens travel to their experts' devices and back. 1 = every device holds
    # every expert. Must divide model.llm.moe.experts
    expert: int = 1
    fsdp: int = 1  # data parallelism with params/optimizer state sharded over this axis
    # Context parallelism: an LLM row is split over this many devices (a context group, inside
    # a host), batch.llm_row_len tokens each, attending as mesh.context_strategy says; the
    # encoders see its devices as more data-parallel ones. 1 = off.
    context: int = 1
    # How a context group's ranks attend (`jaxmllm.models.context`; docs/parallelism.md):
    # gather (each rank all-gathers the group's keys and values every attention layer and
    # computes its dealt query blocks' tiles) | ulysses (all-to-alls turn each rank's tokens of
    # every head into the group's tokens of heads / context heads, each rank computes every
    # tile of the group for its heads, and turn back; Gated DeltaNet layers too)
    context_strategy: str = "gather"
    # Which steps split their LLM rows over the context groups (a context degree per step,
    # docs/parallelism.md): all | long (only the long variants of the step, batch.llm_long_tiles,
    # `jaxmllm.plan.ladder`: the base steps plan each device's own rows of batch.llm_row_len
    # tokens, the context axis one more data-parallel one, so the longest documents no longer
    # set every step's shapes) | auto (the one of the two, or where every document fits a
    # device's row neither (mesh.context 1, its devices data-parallel), that does the most
    # useful work per FLOP, the exchange priced in FLOPs, in trial plans of the data at
    # start-up: `jaxmllm.resolve.degree`; the run's config.json records the choice)
    context_steps: str = "all"
    tensor: int = 1  # tensor parallelism (heads, MLP width, vocab); fastest axis
    # Split CPU-only hosts into this many devices, all processes; 0 = as is. At most
    # MAX_CPU_DEVICES_PER_CORE per CPU core of a process (more only add threads and memory)
    cpu_devices: int = 0

    def __post_init__(self):
        check(
            isinstance(self.context, int) and self.context >= 1,
            "must be >= 1 (the devices one LLM row is split over; 1 = no context parallelism)",
            "context",
        )
        check(
            self.context_strategy in CONTEXT_STRATEGIES,
            f"must be one of {', '.join(CONTEXT_STRATEGIES)}",
            "context_strategy",
        )
        check(
            self.context_steps in CONTEXT_STEPS,
            f"must be one of {', '.join(CONTEXT_STEPS)}",
            "context_steps",
        )
        check(self.stage >= 1, "must be >= 1 (1: no pipeline); -1 is not allowed here", "stage")
        check(
            self.expert >= 1, "must be >= 1 (1: no expert parallelism); -1 is not allowed", "expert"
        )
        check(
            self.cpu_devices >= 0, "must be >= 0 (0: the host's devices as they are)", "cpu_devices"
        )


SCHEDULES = ("auto", "gpipe", "1f1b")
PLACEMENTS = ("auto", "stages", "data")


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism (`mesh.stage` > 1): how layers and encoders are split into stages.

    Left on auto, a partitioner (jaxmllm/pipeline/partition.py) chooses from the cost model,
    with the frozen modules' multipliers, and prints the plan at start-up.
    """

    schedule: str = "auto"  # gpipe | 1f1b | auto (the one with the least predicted step time)
    # Where each encoder (with its projector) runs: stages (its own pipeline stages, in front of
    # the LLM's) | data (data-parallel across the stage axis before the pipeline, each stage
    # encoding a share of the microbatches) | auto (the partitioner's choice)
    vision: str = "auto"
    audio: str = "auto"
    llm_layers: tuple[int, ...] = ()  # LLM layers per LLM stage, first to last; () = auto
    vision_layers: tuple[int, ...] = ()  # vision layers per vision stage (vision: stages)
    audio_layers: tuple[int, ...] = ()  # audio layers per audio stage (audio: stages)
    # Per-step variants: each encoder bucket may also run at these fractions of its capacity
    # (batch.vision_patches, audio_frames); 0 skips the encoder in a step without its modality.
    # One compiled program per variant used; the data thread picks each step's by predicted
    # time among those that hold the step.
    encoder_fractions: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        check(self.schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}", "schedule")
        for key in NAMES:
            check(getattr(self, key) in PLACEMENTS, f"must be one of {', '.join(PLACEMENTS)}", key)
        for key in ("llm_layers", *(f"{name}_layers" for name in NAMES)):
            value = getattr(self, key)
            check(
                isinstance(value, list | tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value),
                "must be a list of layer counts >= 1, one per stage (or [] for auto)",
                key,
            )
            object.__setattr__(self, key, tuple(value))
        fractions = self.encoder_fractions
        check(
            isinstance(fractions, list | tuple)
            and 1.0 in fractions
            and all(isinstance(f, int | float) and 0 <= f <= 1 for f in fractions),
            "must be a list of fractions in [0, 1] that holds 1 (the full bucket)",
            "encoder_fractions",
        )
        object.__setattr__(self, "encoder_fractions", tuple(sorted({float(f) for f in fractions})))

    def placement(self, phase: str) -> str:
        """Where an encoder phase runs: pipeline.<phase> (stages | data | auto)."""
        return getattr(self, phase)

    def layers(self, phase: str) -> tuple[int, ...]:
        """Layers per stage of a stack: pipeline.<phase>_layers (the LLM's or an encoder's)."""
        return getattr(self, f"{phase}_layers")


@dataclass(frozen=True)
class BatchConfig:
    """Per-step batch contract: per device and per microbatch, fixed-capacity buckets."""

    microbatches: int = 1  # gradient-accumulation microbatches per step
    llm_rows: int = 1  # packed LLM rows per device per microbatch
    llm_row_len: int = 4096  # tokens per LLM row; a sample never crosses a row
    vision_patches: int = 4096  # ViT patch capacity per device per microbatch (one packed row)
    audio_frames: int = 3072  # log-mel frame capacity per device per microbatch (one packed row)
    # rows a device may send another LLM bucket a microbatch (a device; under mesh.context a
    # group: its device at the sender's place in its own group)
    route_pair_capacity: int = -1  # 0: local; -1: the dry run's most
    devices_per_host: int = -1  # routing stays within a host first; -1 = a process's devices
    exchange: str = "dense"  # dense all_to_all (every backend) | ragged (ragged_all_to_all: GPU)
    planner: str = "orchestrated"  # one of PLANNER_NAMES (jaxmllm.plan.registry): orchestrated |
    # balanced | grain | naive | first_fit
    capacity: str = "fixed"  # fixed: the sizes above; auto: encoder buckets sized from the data
    # Block-sparse attention: tokens (patches, audio encoder rows) per side of a tile, and the
    # tiles a device computes per microbatch in each phase (its tile lists are padded to these).
    # -1 = auto: sized from the data (orchestrated: the mean need plus a margin, which it never
    # exceeds; other planners: the most any of their buckets needs over the run, a dry run).
    attention_block: int = 128
    llm_tiles: int = -1
    vision_tiles: int = -1
    audio_tiles: int = -1
    # Block-sparse attention's long variants of a step (`jaxmllm.plan.ladder`): per phase the
    # tiles a device computes in each (a step planned for the documents too long for the base's
    # tiles in the phases it raises; 0: the variant below's). Each variant a run uses is one
    # more compiled program (at most 6 long ones). [-1] = auto: sized from the data with
    # the tiles above when those are auto (none where the longest documents cost the base step
    # little, none with mesh.context > 1), else none; [] = none (the tiles above hold every
    # document)
    llm_long_tiles: tuple[int, ...] = (-1,)
    vision_long_tiles: tuple[int, ...] = (-1,)
    audio_long_tiles: tuple[int, ...] = (-1,)
    # cuDNN attention (model.attention: cudnn): the most documents one row of each phase holds,
    # a static size of cuDNN's packed layout (its backward workspace grows with it, ~8 MiB per
    # document at 2048 tokens, 8 heads of 64). -1 = auto: the row over the data's smallest
    # document, which no row can exceed; a row with more is refused naming the key.
    llm_documents: int = -1
    vision_documents: int = -1
    audio_documents: int = -1

    def __post_init__(self):
        for key in ("microbatches", "llm_rows", "llm_row_len"):
            check(getattr(self, key) >= 1, "must be >= 1", key)
        for p in ENCODERS:
            check(p.bucket(self) % 4 == 0, "must be a multiple of 4", p.capacity)
        check(self.planner in PLANNER_NAMES, f"must be one of {sorted(PLANNER_NAMES)}", "planner")
        check(self.capacity in ("fixed", "auto"), "must be fixed or auto", "capacity")
        check(self.exchange in ("dense", "ragged"), "must be dense or ragged", "exchange")
        check(self.route_pair_capacity >= -1, "must be >= 0, or -1", "route_pair_capacity")
        check(self.attention_block >= 1, "must be >= 1", "attention_block")
        for key in AUTO_SIZES[1:]:  # (route_pair_capacity may also be 0)
            check(
                getattr(self, key) >= 1 or getattr(self, key) == -1,
                "must be >= 1, or -1 for auto (resolved at start-up)",
                key,
            )
        ladders = {k: getattr(self, k) for k in AUTO_LADDERS}
        for key, value in ladders.items():
            check(
                value == (-1,) or (len(value) <= LONG_VARIANTS and all(v >= 0 for v in value)),
                f"must be [-1] (auto), or at most {LONG_VARIANTS} tile counts >= 0 (one a long "
                "variant)",
                key,
            )
        lengths = {len(v) for v in ladders.values() if v not in ((-1,), ())}
        check(
            len(lengths) <= 1,
            "every phase's long variants must be as many (0: the variant "
            f"below's tiles); got {ladders}",
            "llm_long_tiles",
        )
        check(
            self.planner != "orchestrated" or self.route_pair_capacity != 0,
            "orchestrated routes encoder rows between devices: set route_pair_capacity "
            "> 0, or -1 for auto",
            "route_pair_capacity",
        )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    lr: float = 3e-4  # peak learning rate
    warmup_steps: int = 100  # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio at the last step
    weight_decay: float = 0.1  # decoupled weight decay (not applied to norms/biases)
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables

    def __post_init__(self):
        # A NaN or inf here is finite nowhere downstream: lr=nan writes NaN into every
        # parameter while the loss and gradient stay finite.
        for key in ("lr", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "clip_norm"):
            value = getattr(self, key)
            check(math.isfinite(value), f"{value!r} must be a finite number", key)
        check(self.lr >= 0, "must be >= 0", "lr")
        check(self.warmup_steps >= 0, "must be >= 0", "warmup_steps")
        check(0 <= self.min_lr_ratio <= 1, "must be in [0, 1]", "min_lr_ratio")
        check(self.weight_decay >= 0, "must be >= 0", "weight_decay")
        for key in ("b1", "b2"):
            check(0 <= getattr(self, key) < 1, "must be in [0, 1) (Adam's decay rate)", key)
        check(0 < self.eps <= 1, "must be in (0, 1]", "eps")
        check(self.clip_norm >= 0, "must be >= 0 (0 disables clipping)", "clip_norm")


@dataclass(frozen=True)
class TrainConfig:
    """Loop, logging and checkpointing."""

    steps: int = 1000  # total optimizer steps
    seed: int = 0  # parameter init seed
    output_dir: str = "runs/default"  # checkpoints, metrics.jsonl, TensorBoard events
    log_every: int = 10  # write metrics every N steps
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the end)
    keep_checkpoints: int = 3  # how many recent checkpoints to keep
    async_checkpointing: bool = True  # write checkpoints in the background
    progress_bar: bool = True  # tqdm bar on the terminal
    max_nonfinite_steps: int = 5  # stop after this many skipped (NaN/inf) steps in a row; 0 = never
    # A step (its batch, the device's work, the loop's bookkeeping) that takes longer ends the
    # process, exit 4, naming the step and where it was (a collective that never completes, a
    # stuck device), for the scheduler to restart it from the last checkpoint; a SIGTERM the
    # loop cannot take while a step hangs does the same. 0 = auto: 10x the median step, at
    # least 300 s; .inf = never. The first 5 steps (which compile) get an hour at least.
    max_step_seconds: float = 0.0
    ledger: bool = False  # write the sample ids of every step to <output_dir>/ledger/ (audits)
    record_timings: bool = True  # each step's time and work to timings.jsonl (calibration)
    # XLA's GPU scheduling flags (jaxmllm/process/xla_flags.py: latency-hiding scheduler,
    # pipelined collectives, double buffering) added when the backend is a GPU; XLA_FLAGS wins
    xla_gpu_flags: bool = True
    peak_tflops: float = 0.0  # a device's dense bf16 peak for MFU; 0: from its kind (or no MFU)
    cost_file: str = ""  # calibrated cost model (data.cost --calibrate): predicted step time
    # Evaluate on data.eval every N steps and at the last step (0: at the last step only);
    # nothing without data.eval.source
    eval_every: int = 0
    # What the step learns from its samples: `sft` (next-token cross entropy over the learned
    # tokens), `dpo` (preference pairs: the `preference` section's loss over each pair's
    # chosen and rejected completions, on the same feed and step) or `grpo` (online RL: the
    # `rl` section's completions sampled from the policy each step, scored, and trained on)
    objective: str = "sft"

    def __post_init__(self):
        positive(self, "steps", "log_every", "checkpoint_every", "keep_checkpoints")
        check(self.objective in OBJECTIVES, f"must be one of {OBJECTIVES}", "objective")
        check(self.eval_every >= 0, "must be >= 0 (0: at the last step only)", "eval_every")
        check(self.max_step_seconds >= 0, "must be >= 0 (0: auto; .inf: never)", "max_step_seconds")
        check(self.max_nonfinite_steps >= 0, "must be >= 0 (0 = never stop)", "max_nonfinite_steps")
        check(self.peak_tflops >= 0, "must be >= 0 (0: from the device's kind)", "peak_tflops")


OBJECTIVES = ("sft", "dpo", "grpo")
PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning (`train.objective: dpo`): the loss over each pair's chosen and
    rejected completions, and the reference policy it measures them against.

    With z = beta x ((chosen - ref chosen) - (rejected - ref rejected)), sums of the
    completions' log-probs: `sigmoid` is DPO, -log sigmoid(z) (with `label_smoothing` e:
    (1 - e) x that + e x -log sigmoid(-z), robust/conservative DPO); `ipo` the squared
    (z / beta - 1 / (2 beta)) on log-probs averaged over each completion's tokens; `simpo`
    reference-free, -log sigmoid(beta x (mean chosen - mean rejected) - simpo_gamma) on
    log-probs averaged over tokens (TRL's formulas: `dpo_loss`, CPO's simpo).
    """

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo
    beta: float = 0.1  # the inverse temperature of the implicit reward (TRL's beta)
    label_smoothing: float = 0.0  # in [0, 0.5): the assumed share of flipped labels
    # Adds this weight x the chosen completion's negative log-likelihood averaged over its
    # tokens (RPO, LLaMA-Factory's pref_ftx): keeps the chosen answers likely
    sft_weight: float = 0.0
    simpo_gamma: float = 0.5  # simpo's target reward margin (TRL's simpo_gamma)
    # The reference policy: `base` (the policy's starting weights, frozen: model.init_from,
    # or the run's initial parameters; with LoRA the adapters switched off, no second copy),
    # a checkpoint of the same architecture and vocabulary (an HF directory or a run
    # directory: its latest checkpoint), or `precomputed`: the starting weights' log-probs of
    # every pair, computed in one pass before training into <output_dir>/reference_logps/
    # (resumable), then no reference is held or run. simpo needs none.
    reference: str = "base"

    def __post_init__(self):
        check(self.loss in PREFERENCE_LOSSES, f"must be one of {PREFERENCE_LOSSES}", "loss")
        check(self.beta > 0, "must be > 0", "beta")
        check(0 <= self.label_smoothing < 0.5, "must be in [0, 0.5)", "label_smoothing")
        check(self.sft_weight >= 0, "must be >= 0", "sft_weight")
        check(bool(self.reference), "must be base or a checkpoint directory", "reference")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (`jax.distributed`): one process per host, or per GPU.

    Empty / -1 fields come from the environment: JAXMLLM_COORDINATOR, JAXMLLM_NUM_PROCESSES,
    JAXMLLM_PROCESS_ID (set by `launch/`), else JAX's cluster auto-detection (SLURM, Open MPI)
    when a cluster job with more than one task is detected. Nothing set: a single process.
    """

    coordinator: str = ""  # host:port of process 0's coordination service
    num_processes: int = -1  # processes in the job
    process_id: int = -1  # this process, 0 .. num_processes-1
    init_timeout_s: int = 300  # wait this long for every process to join at start-up
    heartbeat_timeout_s: int = 60  # a process silent this long is declared dead; the others stop
    step_timeout_s: int = 600  # a step (or a collective) stuck this long stops the process

    def __post_init__(self):
        positive(self, "init_timeout_s", "heartbeat_timeout_s", "step_timeout_s")
        check(
            self.num_processes == -1 or self.num_processes >= 1,
            "must be >= 1, or -1 (from the environment)",
            "num_processes",
        )
        check(self.process_id >= -1, "must be >= 0, or -1 (from the environment)", "process_id")
        check(
            not self.coordinator or ":" in self.coordinator,
            f"{self.coordinator!r} must be host:port",
            "coordinator",
        )
