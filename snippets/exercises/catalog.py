"""The learning guide's exercises, one entry each: where the solution lives and how it is checked.

An exercise is a section of a real module, between `# --8<-- [start:exercise-N]` and
`# --8<-- [end:exercise-N]` (one exercise may own several sections, like 11's save and load). The
stub generator blanks those sections out of a copy of the module; the checker imports the learner's
copy and runs the function named in `check` from the exercise's check file; the exercise pages
include the same sections as the solutions. Where a section holds more than the exercise (the
course's from-scratch modules, whose sections the lessons include), `blank` names the functions
whose bodies are blanked instead, signatures and docstrings kept. So adding an exercise is
adding an entry here, its sections in the module, and its check function: nothing else has to
change. An exercise that names functions or classes in `empty` also has an empty-file variant
(snippets/exercises/empty.py): their interface alone, graded by the same check.

An exercise is *available* once its file, every one of its sections and its check exist; until
then `list` shows it with `arrives_with`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The checks, one file per exercise, named by its number: checks/ex07_gpt_forward.py holds
# exercise 7's. The files of the package whose names start with `_` hold what several share.
CHECKS_DIR = Path(__file__).resolve().parent / "checks"


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str  # what to implement, as the learner finds it in the file
    file: str  # path of the solution module, relative to the repository root
    sections: tuple[str, ...]  # the snippet sections that hold the solution
    task: str  # one sentence: what the code must do (the stub's TODO comment)
    concept: str
    difficulty: str
    hints: tuple[str, ...]
    check: str  # name of the function in the exercise's check file, check_path
    phase: int
    depends_on: tuple[int, ...] = ()
    arrives_with: str = ""  # where the solution module comes from, while it does not exist yet
    # The functions (`name` or `Class.method`) whose bodies the learner writes, when the
    # sections hold more than the exercise: the stub keeps their signatures and docstrings.
    blank: tuple[str, ...] = ()
    # The page (relative to docs/) whose lesson teaches this code and ends with this exercise.
    lesson: str = ""
    # The top-level functions and classes of the empty-file variant (`stubs --empty N`): the
    # learner gets their interface only (signatures and docstrings) and writes them whole.
    empty: tuple[str, ...] = ()

    @property
    def solution_path(self) -> Path:
        return REPO_ROOT / self.file

    @property
    def check_path(self) -> Path | None:
        """checks/exNN_<what>.py, NN this exercise's number; None unless exactly one exists."""
        found = list(CHECKS_DIR.glob(f"ex{self.number:02d}_*.py"))
        return found[0] if len(found) == 1 else None

    @cached_property
    def available(self) -> bool:
        # Read, not imported: `list`, `hints` and `stubs` then start without importing torch.
        checks = self.check_path
        if (not self.solution_path.is_file() or checks is None
                or f"\ndef {self.check}(" not in checks.read_text(encoding="utf-8")):
            return False
        text = self.solution_path.read_text(encoding="utf-8")
        return (all(f"[start:{s}]" in text and f"[end:{s}]" in text for s in self.sections)
                and all(f"def {name.rpartition('.')[2]}(" in text for name in self.blank))


GPT_FILE = "snippets/models/gpt.py"
OPTIM_FILE = "snippets/training/optim.py"
DDP_FILE = "snippets/training/ddp_trainer.py"
FSDP_FILE = "snippets/training/fsdp_trainer.py"
COLLECTIVES_FILE = "snippets/scratch/collectives.py"
SAMPLER_FILE = "snippets/scratch/sampler.py"
PIPELINE_FILE = "snippets/scratch/pipeline.py"
TP_FILE = "snippets/scratch/tensor_parallel.py"
DDP_SCRATCH_FILE = "snippets/scratch/ddp.py"
ZERO_FILE = "snippets/scratch/zero.py"
MOE_FILE = "snippets/scratch/moe.py"
SP_FILE = "snippets/scratch/sequence_parallel.py"
THREE_D_FILE = "snippets/scratch/three_d.py"

EXERCISES: tuple[Exercise, ...] = (
    # ------------------------------------------------------------ phase 1: the model
    Exercise(
        number=1, title="RMSNorm.forward", file=GPT_FILE, sections=("exercise-1",), phase=1,
        task="scale each vector x to unit root-mean-square over its last dimension, then "
             "multiply by self.weight",
        concept="Tensor operations, broadcasting, normalisation",
        difficulty="Easy (1-3 lines)",
        hints=(
            "the root mean square of a vector is sqrt(mean(x**2)) over the last dimension; "
            "keepdim=True keeps a size-1 dimension so the division broadcasts over the vector",
            "torch.rsqrt(m + self.eps) is 1/sqrt(m + eps): eps keeps an all-zero vector "
            "from dividing by zero",
            "RMSNorm does not subtract the mean (LayerNorm does): it only rescales",
            "compute in float32 (x.float()) and return out.to(x.dtype): squares of "
            "float16 values above 256 overflow",
        ),
        check="check_rmsnorm",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=2, title="rotate_half", file=GPT_FILE, sections=("exercise-2",), phase=1,
        task="split the last dimension into halves (x1, x2) and return (-x2, x1)",
        concept="Tensor slicing for rotary position embeddings",
        difficulty="Easy (2-3 lines)",
        hints=(
            "x.chunk(2, dim=-1) returns the two halves of the last dimension",
            "torch.cat((a, b), dim=-1) puts them back side by side",
            "the NEGATED second half comes first: rotate_half([1, 2, 3, 4]) is [-3, -4, 1, 2]",
        ),
        check="check_rotate_half",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=3, title="apply_rotary_pos_emb", file=GPT_FILE, sections=("exercise-3",), phase=1,
        task="rotate q and k by their positions' angles: x * cos + rotate_half(x) * sin, "
             "and return both",
        concept="Rotary position embeddings (RoPE)",
        difficulty="Easy (2-3 lines, once the formula makes sense)",
        hints=(
            "each pair (x_i, x_{i+d/2}) is a point in a plane; rotating it by angle a gives "
            "(x_i cos a - x_{i+d/2} sin a, x_{i+d/2} cos a + x_i sin a)",
            "that is x * cos + rotate_half(x) * sin, with the cos and sin tables given "
            "(they broadcast over batch and heads)",
            "rotate both q and k, never v, and return them as a tuple (q, k)",
        ),
        depends_on=(2,),
        check="check_apply_rotary_pos_emb",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=4, title="MLP.forward", file=GPT_FILE, sections=("exercise-4",), phase=1,
        task="SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))",
        concept="Gated activations (SwiGLU), modern MLP design",
        difficulty="Easy (1 line)",
        hints=(
            "two parallel projections of x: gate_proj(x) goes through F.silu, up_proj(x) does not",
            "multiply them element by element, then project back with down_proj",
            "SiLU, not GELU or ReLU: silu(z) = z * sigmoid(z)",
        ),
        check="check_mlp",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=5, title="CausalSelfAttention.forward (eager branch)", file=GPT_FILE,
        sections=("exercise-5",), phase=1,
        task="scores = q @ k^T / sqrt(head_dim), future positions set to -inf, softmax over "
             "the keys, y = probs @ v",
        concept="Scaled dot-product attention with a causal mask",
        difficulty="Medium (5-8 lines)",
        hints=(
            "q and k are (B, heads, T, head_dim): q @ k.transpose(-2, -1) gives (B, heads, T, T) "
            "scores, one row per query position",
            "divide by math.sqrt(self.head_dim) so the scores' spread does not grow with head_dim",
            "position t may look at positions 0..t only: build a (T, T) lower-triangular "
            "boolean mask (torch.ones(T, T, dtype=torch.bool).tril()) and masked_fill the rest "
            "with float('-inf') BEFORE the softmax",
            "softmax over the last dimension (the keys), then y = probs @ v",
        ),
        depends_on=(3,),
        check="check_attention",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=6, title="GPT._init_weights", file=GPT_FILE, sections=("exercise-6",), phase=1,
        task="initialise Linear and Embedding weights from N(0, initializer_range), residual "
             "outputs scaled by 1/sqrt(2 * num_hidden_layers), biases to 0, RMSNorm weights to 1",
        concept="Weight initialisation, the isinstance() pattern",
        difficulty="Easy (5-10 lines)",
        hints=(
            "model.apply(fn) calls fn on every submodule: branch with isinstance(module, "
            "nn.Linear), nn.Embedding, RMSNorm",
            "nn.init.normal_ fills a weight in place from a normal distribution: mean 0, and the "
            "config's initializer_range as its std",
            "linears with module.is_residual_output = True (o_proj, down_proj) add into the "
            "residual stream: divide their std by math.sqrt(2 * self.config.num_hidden_layers)",
            "nn.init.zeros_ for a bias if there is one; nn.init.ones_ for RMSNorm.weight",
        ),
        check="check_init_weights",
        lesson="workshop/session-a/slides.md",
    ),
    Exercise(
        number=7, title="GPT.forward", file=GPT_FILE, sections=("exercise-7",), phase=1,
        task="embed, run the blocks (through checkpoint() when gradient_checkpointing and "
             "training), final norm, lm_head, and the cross-entropy loss when targets are given",
        concept="The full model pipeline, gradient checkpointing, the next-token loss",
        difficulty="Medium (10-15 lines)",
        hints=(
            "the token ids go through the embedding first, then through every block of self.layers "
            "in turn, each taking the previous one's output",
            "with self.config.gradient_checkpointing and self.training, call checkpoint(block, x, "
            "use_reentrant=False) instead of block(x)",
            "the final self.norm before self.lm_head: the blocks are pre-norm, so the stream "
            "leaving the last block was never normalised",
            "targets are already the next tokens (the caller shifted them): do not shift again. "
            "F.cross_entropy wants (N, vocab) logits and (N,) targets, so flatten the batch and "
            "time dimensions of both; a target of -100 is ignored",
            "return (logits, loss), with loss None when targets is None",
        ),
        depends_on=(1, 2, 3, 4, 5, 6),
        check="check_gpt_forward",
        lesson="workshop/session-a/slides.md",
    ),
    # ------------------------------------------------------------ phase 2: the training loop
    Exercise(
        number=8, title="build_optimizer (optim.py)", file=OPTIM_FILE,
        sections=("exercise-8",), phase=2,
        task="AdamW with two parameter groups: weight_decay on the matrices, 0.0 on the 1-D "
             "parameters (norm gains, biases), frozen parameters left out",
        concept="Parameter groups, weight decay, AdamW",
        difficulty="Easy-Medium (10-15 lines)",
        hints=(
            "loop over model.named_parameters() and skip parameters that do not require grad",
            "p.dim() >= 2 (Linear and Embedding weights) goes to the decay group; p.dim() < 2 "
            "(RMSNorm gains, biases) to the no-decay group",
            "torch.optim.AdamW takes a list of parameter groups, dicts with their own 'params' and "
            "'weight_decay'; the learning rate is the lr argument and the betas (0.9, 0.95)",
            "the tied embed_tokens / lm_head matrix is one Parameter: named_parameters() yields it "
            "once, and it must be in one group only",
        ),
        check="check_build_optimizer",
        lesson="workshop/session-b/slides.md",
        arrives_with="the DDP trainer (Week 1)",
    ),
    Exercise(
        number=9, title="lr_at (optim.py)", file=OPTIM_FILE, sections=("exercise-9",),
        phase=2,
        task="linear warmup to lr over warmup_steps, cosine decay to min_lr at max_steps, then "
             "min_lr",
        concept="Learning-rate schedules: warmup and cosine decay",
        difficulty="Easy (5-8 lines)",
        hints=(
            "everything comes from the arguments: lr, min_lr, warmup_steps, max_steps",
            "warmup: lr * (step + 1) / warmup_steps, so step 0 already moves and step warmup_steps "
            "- 1 reaches the peak",
            "from step max_steps on, return min_lr",
            "in between, measure the progress from 0 (the end of the warm-up) to 1 (max_steps): "
            "half a period of a cosine, shifted and scaled to fall from 1 to 0 over that progress, "
            "is the fraction of the distance from min_lr to lr still left",
        ),
        check="check_lr_at",
        lesson="workshop/session-b/slides.md",
        arrives_with="the DDP trainer (Week 1)",
    ),
    Exercise(
        number=10, title="DistributedTrainer.train_step", file=DDP_FILE,
        sections=("exercise-10", "exercise-10-forward-backward", "exercise-10-clip"), phase=2,
        task="one optimizer step: set the scheduled lr, accumulate the gradients of "
             "grad_accum_steps micro-batches, clip, step, clear the gradients, return the stats",
        concept="The training step: gradient accumulation, clipping, scheduling",
        difficulty="Hard (20-30 lines)",
        hints=(
            "the schedule gives this step's learning rate (self.get_lr(self.step)); the optimizer "
            "reads it from each of its param_groups, so write it there before stepping. Then "
            "train_step calls self.forward_backward(batch_iter) and self.clip_gradients(), "
            "the two other methods of this exercise",
            "each of the grad_accum_steps micro-steps takes the next batch from batch_iter, splits "
            "it into inputs and next-token targets with shift_for_next_token, and runs forward and "
            "backward inside self._grad_sync(...): only the last micro-step synchronises",
            "backward (loss / grad_accum_steps): backward() adds into .grad, so the sum of the "
            "scaled gradients is the gradient of the mean over the whole batch",
            "after the last backward: clip the gradients' global norm to train_config.grad_clip "
            "(torch.nn.utils.clip_grad_norm_ returns the norm before clipping; a grad_clip of 0 "
            "means no clipping), step the optimizer, then clear the gradients to None",
            "self.step += 1, and return {'loss': mean of the micro-batch losses, 'grad_norm', "
            "'lr', 'tokens': targets trained on, times self.world_size}",
        ),
        depends_on=(8, 9),
        check="check_train_step",
        lesson="workshop/session-b/slides.md",
        arrives_with="the DDP trainer (Week 1)",
    ),
    Exercise(
        number=11, title="DistributedTrainer.save_checkpoint and load_checkpoint", file=DDP_FILE,
        sections=("exercise-11-save", "exercise-11-load"), phase=2,
        task="save everything a run needs to continue exactly (unwrapped weights, optimizer, "
             "step, data position, RNG states, configs), and load it back",
        concept="State dicts, unwrapping DDP, resuming training",
        difficulty="Easy-Medium (about 10 lines each)",
        hints=(
            "DDP keeps your model in .module: save unwrap_model(self.model).state_dict(), or "
            "every key starts with 'module.' and only another wrapped model can load it",
            "save self.optimizer.state_dict() too (AdamW's moments) and self.step (the lr "
            "schedule's position), or the resumed run takes different steps",
            "the data position is self.sampler.state_dict(); capture_rng_state() holds the RNGs",
            "only tensors, numbers, strings and plain containers: self.config.to_dict() and "
            "asdict(self.train_config), so the file loads with weights_only=True",
            "write with save_atomic(path, state), read with load_verified(path, "
            "map_location='cpu'), then load each piece back and return the state",
        ),
        check="check_checkpoint",
        lesson="workshop/session-b/slides.md",
        arrives_with="the DDP trainer (Week 1)",
    ),
    # ------------------------------------------------------------ phase 3: FSDP
    Exercise(
        number=12, title="FSDPTrainer._get_sharding_strategy", file=FSDP_FILE,
        sections=("exercise-12",), phase=3,
        task="map the strategy name (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD) to "
             "fully_shard's arguments, {'mesh': self._device_mesh(replicas, shards), "
             "'reshard_after_forward': bool}, so that each strategy stores, holds and "
             "all-gathers what it promises: the check measures it on 2 processes",
        concept="ZeRO stages: memory against communication, measured",
        difficulty="Easy (5-10 lines), once you can predict each strategy's memory",
        hints=(
            "predict first, for 2 ranks: the share of the parameters each rank stores, the "
            "share it holds between forward and backward, and the all-gathers in forward and "
            "in backward; the check prints what your mapping measures",
            "a mesh of shape (replicas, shards): `shards` ranks split one copy of the model, and "
            "`replicas` such groups hold identical copies; replicas * shards = self.world_size",
            "FULL_SHARD (ZeRO-3) shards over every rank and frees the gathered parameters after "
            "forward (reshard_after_forward=True): they are all-gathered again for backward",
            "SHARD_GRAD_OP (ZeRO-2) shards the same way but keeps the gathered parameters until "
            "backward (reshard_after_forward=False): one all-gather per step instead of two",
            "NO_SHARD is DDP: self.world_size replicas of 1 rank each; HYBRID_SHARD shards "
            "within groups of self.shard_group_size ranks (a node) and replicates across groups",
        ),
        check="check_sharding_strategy",
        lesson="course/week-2/fsdp.md",
    ),
    Exercise(
        number=13, title="FSDPTrainer._get_mixed_precision_policy", file=FSDP_FILE,
        sections=("exercise-13",), phase=3,
        task="return the MixedPrecisionPolicy for self.fsdp_config.mixed_precision (bf16, "
             "fp16 or fp32) that gathers and computes in that dtype, reduces gradients in "
             "float32, hands the loss back in float32 and casts every unit's inputs to the "
             "compute dtype; raise ConfigError for any other name. The check measures what "
             "your policy makes FSDP2 do on 2 processes",
        concept="Mixed precision under FSDP: what each field of the policy changes, measured",
        difficulty="Easy (about 10 lines), once you can predict what each field does",
        hints=(
            "predict first, for 2 ranks, fp32 against bf16: the bytes one forward all-gathers, "
            "the bytes one backward reduce-scatters, the dtype of the loss handed back, and "
            "what a block handed fp32 activations computes in; the check prints what your "
            "policy measures",
            "MixedPrecisionPolicy has four fields: param_dtype (what each unit's all-gather "
            "produces and computes in), reduce_dtype (what gradients are reduce-scattered in), "
            "output_dtype (what every unit's outputs are cast to) and cast_forward_inputs",
            "reduce_dtype defaults to param_dtype: leave it out and bf16 gradients are summed "
            "over ranks in bf16, every partial sum rounded to 8 significant bits",
            "output_dtype applies to EVERY unit, the blocks too, not only the model; this GPT "
            "computes its loss in fp32 itself (logits.float()), so leave it None",
            "cast_forward_inputs=True (the default) casts a unit's floating-point inputs to "
            "param_dtype, so fp32 activations never meet bf16 weights in a matmul",
        ),
        check="check_mixed_precision_policy",
        lesson="course/week-2/fsdp.md",
    ),
    Exercise(
        number=14, title="FSDPTrainer._get_fsdp_policy", file=FSDP_FILE,
        sections=("exercise-14",), phase=3,
        task="return the modules that become FSDP units, in the order fully_shard is applied, "
             "so that few parameters are whole at once: the check counts the all-gathers "
             "and measures the peak share of whole parameters your units give",
        concept="FSDP wrapping granularity: units set the peak memory and the message count",
        difficulty="Easy (2-3 lines)",
        hints=(
            "each unit is all-gathered in one collective just before it runs and freed after: "
            "the unit size sets the peak memory and how much communication can overlap compute",
            "predict the peak for the model alone as one unit, and for one unit per Block "
            "plus the model: the check prints what yours measures",
            "the blocks: [m for m in model.modules() if isinstance(m, Block)]",
            "fully_shard goes bottom-up: a unit takes every parameter not claimed by an earlier "
            "unit, so the model itself (embedding, lm_head, final norm) comes LAST",
        ),
        check="check_fsdp_policy",
        lesson="course/week-2/fsdp.md",
    ),
    Exercise(
        number=15, title="FSDPTrainer.save_checkpoint", file=FSDP_FILE,
        sections=("exercise-15",), phase=3,
        task="gather the sharded model and optimizer state into full tensors on rank 0 with "
             "get_state_dict and write them, with step, sampler, RNG and configs, atomically "
             "from rank 0 only",
        concept="Distributed checkpointing: gathering sharded state",
        difficulty="Medium (about 15 lines)",
        hints=(
            "self.model.state_dict() holds DTensors, this rank's slices: neither a plain GPT nor "
            "torch.load(weights_only=True) accepts them",
            "get_state_dict gathers the model's and the optimizer's state at once; its "
            "StateDictOptions ask for full tensors (full_state_dict) moved to the CPU "
            "(cpu_offload). It is a collective, so EVERY rank calls it",
            "with cpu_offload=True only rank 0 receives the tensors (the others get empty dicts): "
            "return None on the other ranks, write on rank 0 only",
            "save the same pieces as exercise 11 (step, self.sampler.state_dict(), "
            "capture_rng_state(), configs as dicts) with save_atomic(path, state)",
        ),
        depends_on=(12, 13, 14),
        check="check_fsdp_checkpoint",
        lesson="course/week-2/fsdp.md",
    ),
    # ------------------------------------------------------------ phase 4: the parallelisms
    # Each exercise is a function of the course's from-scratch modules (snippets/scratch/):
    # the stub keeps its signature and docstring and blanks its body. The checks run it on
    # gloo processes where it communicates (snippets/exercises/checks/, one file each).
    Exercise(
        number=16, title="ring_all_reduce (collectives.py)", file=COLLECTIVES_FILE,
        sections=("ring-all-reduce",), blank=("ring_all_reduce",), phase=4,
        task="sum tensor over all ranks, in place, with send/recv to the ring neighbours only: "
             "a reduce-scatter phase of world-1 steps, then an all-gather phase of world-1 steps",
        concept="Ring all-reduce, what NCCL does for dist.all_reduce (Week 1)",
        difficulty="Medium (15-20 lines)",
        hints=(
            "cut the flat tensor into world chunks that are views of it (tensor_split accepts "
            "sizes that do not divide evenly), so writing a chunk writes the tensor; your right "
            "neighbour is the next rank around the ring, your left the previous one",
            "every step sends one chunk right and receives one from the left: start the send with "
            "dist.isend, then dist.recv into a fresh buffer, then wait on the send. If every rank "
            "calls a blocking recv first, no one is sending: a deadlock",
            "reduce-scatter: at each step every rank sends a different chunk, and adds the chunk "
            "it receives into the one it will send at the next step, so the partial sums grow "
            "around the ring; after world-1 steps each rank holds one chunk summed over all the "
            "ranks. Follow it on paper for 3 ranks: which chunk does rank r send first?",
            "all-gather: each rank starts by sending the chunk it finished (for rank r, the one "
            "after its own index), and every chunk it receives is finished too: it replaces your "
            "copy (copy, do not add) and is the one you pass on at the next step; return tensor",
        ),
        check="check_ring_all_reduce",
        empty=("ring_all_reduce",),
        lesson="course/week-1/ring-allreduce.md",
    ),
    Exercise(
        number=17, title="ShardedSampler (sampler.py)", file=SAMPLER_FILE,
        sections=("sampler",), blank=("ShardedSampler.__init__", "ShardedSampler.__iter__"),
        phase=4,
        task="give rank `rank` of `num_replicas` its share of the dataset's indices, index for "
             "index as torch's DistributedSampler: one permutation shared by every rank, padded "
             "(or trimmed with drop_last) to a multiple of num_replicas, then strided",
        concept="Data sharding: which examples each rank trains on, epoch by epoch (Week 1)",
        difficulty="Easy-Medium (15 lines)",
        hints=(
            "__init__ keeps its arguments and sets what the rest of the class reads: self.epoch (0 "
            "until set_epoch), self.num_samples (what __len__ returns) and self.total_size (every "
            "rank's samples together)",
            "every rank must get the same number of examples, or one leaves its epoch early and "
            "the others wait for it in the all-reduce: round n / replicas up (padding the "
            "indices), or down with drop_last",
            "shuffle with torch.randperm and a torch.Generator of your own: seed it with the same "
            "number on every rank, so that they all build one permutation, and put the epoch in "
            "that number, so that set_epoch reshuffles",
            "pad the list by repeating indices from its start (or cut it, with drop_last) to "
            "total_size; then each rank takes every num_replicas-th index starting at its own "
            "rank: strided, not a contiguous block",
        ),
        check="check_sampler",
        lesson="course/week-1/ddp-from-scratch.md",
    ),
    Exercise(
        number=18, title="one_f_one_b_schedule (pipeline.py)", file=PIPELINE_FILE,
        sections=("schedules",), blank=("one_f_one_b_schedule",), phase=4,
        task="return stage_index's list of actions, ('F', i) and ('B', i), in 1F1B order: "
             "warm-up forwards, then one forward and one backward in turn, then the last "
             "backwards",
        concept="Pipeline schedules: the 1F1B order and its memory (Week 3)",
        difficulty="Medium (6-8 lines)",
        hints=(
            "gpipe_schedule above returns the same kind of list: all forwards, then all backwards",
            "warm-up: the last stage can start a backward right after its first forward; each "
            "stage before it runs one forward more before its first backward, because its first "
            "gradient comes back one hop later. With fewer micro-batches, all of them",
            "steady state: after the warm-up, alternate one forward (the next micro-batch not yet "
            "run) and one backward (the oldest micro-batch not yet run backward), forward first, "
            "until every forward has run",
            "cool-down: the backwards still owed, oldest first: the next stage sends their "
            "gradients back in the order it ran them",
        ),
        check="check_one_f_one_b",
        empty=("one_f_one_b_schedule",),
        lesson="course/week-3/pipeline-from-scratch.md",
    ),
    Exercise(
        number=19, title="f, g and the parallel linears (tensor_parallel.py)", file=TP_FILE,
        sections=("f-and-g", "linears"),
        blank=("EnterTensorParallel.forward", "EnterTensorParallel.backward",
               "LeaveTensorParallel.forward", "LeaveTensorParallel.backward",
               "ColumnParallelLinear.__init__", "ColumnParallelLinear.forward",
               "RowParallelLinear.__init__", "RowParallelLinear.forward"),
        phase=4,
        task="f: identity forward, all-reduce of the gradient backward; g: all-reduce forward, "
             "identity backward; a column-parallel linear keeps a block of W's rows, a "
             "row-parallel one a block of W's columns and leaves the region through g",
        concept="Tensor parallelism (Megatron-LM): one all-reduce per direction (Week 4)",
        difficulty="Medium (about 20 lines in 8 short methods)",
        hints=(
            "_tp_rank_and_size(group) gives this rank's index and the group's size. A Linear's "
            "weight is (out_features, in_features): column-parallel keeps this rank's block of "
            "rows, row-parallel its block of columns, each a new nn.Parameter of a clone",
            "the column-parallel forward needs no communication: its output is this rank's slice "
            "of the features. The row-parallel forward multiplies its slice of the input by its "
            "block of columns, a partial sum: it leaves the region through g "
            "(LeaveTensorParallel.apply), which adds the ranks' partial sums",
            "g sums the ranks' partial results in forward: record it in stats, then all-reduce a "
            "clone (never modify a forward input in place). In backward the gradient of a sum is "
            "the same for every term: return it unchanged, and None for group and stats",
            "f is the identity in forward (return a view of x; keep group and stats on ctx); in "
            "backward each rank's gradient of x covers only its slice of the features: record it, "
            "then sum it over the ranks (all-reduce a clone) and return it",
        ),
        check="check_tensor_parallel",
        lesson="course/week-4/tensor-parallel-from-scratch.md",
    ),
    Exercise(
        number=20, title="OverlappedDDP's hooks (ddp.py)", file=DDP_SCRATCH_FILE,
        sections=("overlapped",), blank=("OverlappedDDP._make_hook", "OverlappedDDP._finish"),
        phase=4,
        task="from each parameter's post-accumulate-grad hook, launch its bucket's async "
             "all-reduce when the bucket's last gradient arrives; when backward ends, wait on "
             "every handle, unpack the averages, and reset for the next backward",
        concept="Bucketed DDP overlapping communication with backward (Week 1)",
        difficulty="Medium-Hard (about 25 lines)",
        hints=(
            "_make_hook returns hook(param): return at once when not self.require_sync (inside "
            "no_sync); on the first gradient of a backward, queue self._finish with "
            "torch.autograd.Variable._execution_engine.queue_callback and set self.callback_queued",
            "count the bucket's gradients as they arrive; when the last one is in (earlier, some "
            "of its .grad do not exist yet), pack the bucket and launch its all-reduce without "
            "waiting for it (async_op=True), keeping the bucket and the handle in self.pending",
            "_finish runs when backward has ended: only there wait on each handle, and only after "
            "its wait unpack the bucket, scaled to the mean (the all-reduce sums, and each rank's "
            "loss was a mean over its own examples)",
            "then reset: bucket.ready = 0 for every bucket, self.pending = [], "
            "self.callback_queued = False; or the next backward never fills a bucket",
        ),
        check="check_overlapped_ddp",
        empty=("OverlappedDDP",),
        lesson="course/week-1/ddp-from-scratch.md",
    ),
    Exercise(
        number=21, title="ZeRO1Optimizer.step (zero.py)", file=ZERO_FILE,
        sections=("zero1-step",), phase=4,
        task="average the gradients over the ranks, step AdamW on this rank's shard only, then "
             "all-gather every rank's updated shard into the full parameters",
        concept="ZeRO-1: optimizer state sharded (Week 2)",
        difficulty="Easy-Medium (4-5 lines)",
        hints=(
            "self.flat_grads holds every parameter's gradient end to end (each p.grad is a view of "
            "it): one all-reduce of it through self.comm sums every gradient over the ranks, in "
            "place",
            "all_reduce sums: divide by dist.get_world_size() for the mean, as DDP does. AdamW "
            "would hide a factor N in the weights, but not in a clipped or logged gradient",
            "self.optimizer is an AdamW over self.shard, a view of this rank's slice of the "
            "weights and of the gradients: self.optimizer.step() updates that slice only, with "
            "moments for 1/N of the parameters",
            "then every rank needs every updated slice: all-gather the slices into self.flat.full "
            "through self.comm (self.flat.local gives this rank's slice of a flat tensor). AFTER "
            "the step; gathered before it, the other shards stay a step behind",
        ),
        check="check_zero1",
        empty=("ZeRO1Optimizer",),
        lesson="course/week-2/zero-from-scratch.md",
    ),
    Exercise(
        number=22, title="ZeRO2Optimizer._grad_ready (zero.py)", file=ZERO_FILE,
        sections=("zero2",), blank=("ZeRO2Optimizer._grad_ready",), phase=4,
        task="count bucket i's gradients; when the last one is in, reduce-scatter the bucket's "
             "flat gradient so this rank receives the mean of its own shard, add it to the "
             "shard's .grad, free the full gradients and reset the count",
        concept="ZeRO-2: gradients reduce-scattered, not all-reduced (Week 2)",
        difficulty="Medium (12-15 lines)",
        hints=(
            "autograd calls this hook once per parameter of bucket i: count them in self.ready[i], "
            "and do nothing until the bucket's last gradient is in; before that some .grad do not "
            "exist",
            "a reduce-scatter through self.comm of the bucket's flat gradient "
            "(bucket.flat_grad()), into a new tensor shaped like this rank's shard, gives it the "
            "SUM of its shard over the ranks: divide by the world size for the mean",
            "with gradient accumulation several backwards add into one step: set the shard's .grad "
            "the first time, add into it after that",
            "then free the bucket's full gradients (ZeRO-2's saving: only the shard remains), "
            "reset the bucket's count for the next backward, and mark it in self.reduced (step() "
            "checks it)",
        ),
        check="check_zero2",
        lesson="course/week-2/zero-from-scratch.md",
    ),
    Exercise(
        number=23, title="ZeRO-3's gather, free and re-gather (zero.py)", file=ZERO_FILE,
        sections=("zero3-unit", "zero3"),
        blank=("ShardedUnit.gather", "ShardedUnit.free", "ZeRO3._after_forward"), phase=4,
        task="gather: give the unit's flat buffer its bytes back and all-gather the shards into "
             "it; free: release those bytes; after a unit's forward, free it and hook its "
             "outputs so backward gathers it again just before it needs the weights",
        concept="ZeRO-3: parameters sharded, gathered just in time (Week 2)",
        difficulty="Medium (about 12 lines in 3 methods)",
        hints=(
            "the parameters are views of self.flat.full, and autograd keeps views of them for "
            "backward: free the BYTES, not the tensor. A tensor's untyped_storage() can be resized "
            "in place, to 0 and back to self.full_bytes; every view then sees the weights again",
            "gather gives the storage its bytes back, then all-gathers every rank's shard "
            "(self.shard, detached) into self.flat.full through self.comm; gather and free keep "
            "self.gathered up to date, so that a second call does nothing",
            "_after_forward frees the unit, then hooks each output tensor that requires grad "
            "(tensors_in(output)): a tensor's hook runs when its gradient is computed, and this "
            "one gathers the unit and returns the gradient unchanged",
            "backward reaches a unit's output gradient just before the unit's own backward: that "
            "is when its weights must be back. The forward pre-hook (gather) and the gradient hook "
            "(reduce-scatter, then free) are already registered in __init__",
        ),
        check="check_zero3",
        lesson="course/week-2/zero-from-scratch.md",
    ),
    Exercise(
        number=24, title="dispatch_to_experts (moe.py)", file=MOE_FILE,
        sections=("dispatch",), blank=("dispatch_to_experts",), phase=4,
        task="exchange the per-expert counts with an all_to_all, send each row to the rank "
             "holding its expert, run the local experts on their rows grouped by expert, and "
             "send the results back in the order the rows came",
        concept="Expert parallelism: two all_to_alls, counts first (Week 3)",
        difficulty="Medium-Hard (about 15 lines)",
        hints=(
            "counts first: an all_to_all_single of tokens_per_expert tells every rank how many "
            "rows each rank will send to each of its local experts; viewed as (world, local), row "
            "s of what you receive is what rank s sends you",
            "all_to_all's splits are per RANK, not per expert: add up the counts of each rank's "
            "local experts, for what you send and for what you receive; move the rows with "
            "AllToAll.apply, which gradients can pass through",
            "the received rows are ordered by source rank, then expert: cut them into those pieces "
            "and put them in expert order before running the local experts (moe.run_local_experts "
            "takes the rows and each expert's count)",
            "cut the outputs the same way and put them back in (source, expert) order; the return "
            "trip is the same all_to_all with the splits swapped",
        ),
        check="check_moe_dispatch",
        lesson="course/week-3/moe.md",
    ),
    Exercise(
        number=25, title="SP's gather and scatter edges (sequence_parallel.py)",
        file=SP_FILE, sections=("collectives", "enter-and-leave", "replicated-grads"),
        blank=("all_gather_sequence", "reduce_scatter_sequence", "GatherSequence.forward",
               "GatherSequence.backward", "ScatterSequence.forward", "ScatterSequence.backward",
               "all_reduce_gradient_of"),
        phase=4,
        task="all-gather the tokens along the sequence and reduce-scatter them back; entering a "
             "TP region, all-gather in forward and reduce-scatter the gradient in backward; "
             "leaving it, the converse; and all-reduce the gradient of a weight outside the "
             "regions, which saw only this rank's tokens",
        concept="Sequence parallelism (Megatron-LM): TP's all-reduce split into its two halves",
        difficulty="Medium (about 20 lines in 7 short functions)",
        hints=(
            "the single-tensor collectives (dist.all_gather_single, dist.reduce_scatter_single) "
            "work along dimension 0, the batch here: move the sequence there first (movedim, then "
            "contiguous) and back after; rank i's tokens are block i of the sequence",
            "the output of all_gather_sequence is (B, T, h) from (B, T/N, h) on each rank; "
            "reduce_scatter_sequence gives (B, T/N, h): the sum over the ranks, this rank's tokens "
            "only",
            "GatherSequence: forward all_gather_sequence, backward reduce_scatter_sequence (every "
            "rank's column slice used every token, so each rank's gradient for a token is a "
            "partial sum); ScatterSequence: forward reduce_scatter_sequence, backward "
            "all_gather_sequence. Keep group and stats on ctx; backward returns grad, None, None",
            "record each collective where it is made: stats.record('forward', 'all_gather', full), "
            "stats.record('backward', 'reduce_scatter', grad), and so on",
            "all_reduce_gradient_of: a hook on the parameter (register_hook) sees its gradient "
            "before it is added to .grad: copy it (autograd owns the incoming buffer), record it, "
            "sum it over the group and return the sum",
        ),
        check="check_sequence_parallel",
        lesson="course/week-4/sequence-parallel.md",
    ),
    Exercise(
        number=26, title="the 3-D process groups (three_d.py)", file=THREE_D_FILE,
        sections=("mesh",), blank=("Mesh.groups", "build_groups"), phase=4,
        task="list every group along an axis of the mesh (the ranks whose other two "
             "coordinates are equal), and create every TP, PP and DP group on every rank, in "
             "the same order, keeping the one this rank belongs to for each axis",
        concept="3-D parallelism: which ranks average gradients together (Week 4)",
        difficulty="Easy-Medium (about 12 lines in 2 functions)",
        hints=(
            "self.coords(rank) and self.rank(dp=..., pp=..., tp=...) convert between a rank and "
            "its coordinates in the layout, TP innermost: rank = ((d * pp) + p) * tp + t. A "
            "group along axis fixes the other two coordinates and runs this one over its range",
            "Mesh(2, 2, 2).groups('tp') is [[0, 1], [2, 3], [4, 5], [6, 7]]: consecutive ranks, "
            "one node; groups('dp') is [[0, 4], [1, 5], [2, 6], [3, 7]]",
            "the DP group, over which gradients are averaged, is the replicas of the same stage "
            "AND the same TP shard: not the world, not every rank of the stage",
            "dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) is a collective of the "
            "whole world: every rank calls it for every group of every axis, in the same order, "
            "and keeps the group when rank in ranks",
        ),
        check="check_3d_groups",
        lesson="course/week-4/three-d.md",
    ),
    Exercise(
        number=27, title="make_buckets and BucketedDDP.sync_gradients (ddp.py)",
        file=DDP_SCRATCH_FILE, sections=("buckets", "bucketed"),
        blank=("make_buckets", "BucketedDDP.sync_gradients"), phase=4,
        task="group the parameters that require grad into buckets of at most bucket_cap_mb, "
             "last layer first; after backward, all-reduce each bucket's packed gradients in "
             "one message and unpack their mean",
        concept="Gradient buckets: few large all-reduces instead of one per parameter (Week 1)",
        difficulty="Easy-Medium (about 15 lines in 2 functions)",
        hints=(
            "walk the parameters that require grad in reverse order: backward produces the last "
            "layer's gradients first, and those buckets should fill first",
            "the cap is in bytes: cap = bucket_cap_mb * 2**20 and a parameter weighs p.numel() * "
            "p.element_size(); start a new bucket BEFORE adding a parameter that would take the "
            "current one over the cap (an empty bucket always takes it)",
            "return [Bucket(params) for each group], the last group included",
            "sync_gradients: each bucket is packed, all-reduced in one message and unpacked scaled "
            "to the mean: all_reduce sums, and each rank's loss was a mean over its own examples",
        ),
        check="check_bucketed_ddp",
        lesson="course/week-1/ddp-from-scratch.md",
    ),
)

BY_NUMBER = {e.number: e for e in EXERCISES}


def get(number: int) -> Exercise:
    try:
        return BY_NUMBER[number]
    except KeyError:
        raise SystemExit(f"there is no exercise {number}; the exercises are "
                         f"{min(BY_NUMBER)}-{max(BY_NUMBER)}") from None


def all_dependencies(exercise: Exercise) -> list[Exercise]:
    """Every exercise this one builds on, directly or not, in order."""
    seen: set[int] = set()
    stack = list(exercise.depends_on)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(BY_NUMBER[n].depends_on)
    return [BY_NUMBER[n] for n in sorted(seen)]
