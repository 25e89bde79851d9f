"""One GPU check: the learner step and HF generation of a Qwen2.5-1.5B-shaped model, the
colocated cycle (learner and generation taking turns on one GPU), and what one GPU can
settle for the 7B recipe, in bf16.

    python benchmarks/gpu_check.py [--cpu] [--shape qwen2.5-1.5b|tiny] [--device auto|cuda|cpu]
                                   [--stages learner,packed,drift,slice,transfer,generation,colocate,
                                    zero3-colocate-offload,nccl-broadcast,packed-flash,vllm-reload,
                                    vllm-sleep-wake] [--zero-stages 1,2,3] [--wheels DIR]
                                   [--steps 5] [--slice-layers 2,4] [--transfer-gb 15.2]
                                   [--transfer-chunk-mb 512] [--budget-s 420]
                                   [--out benchmarks/out/gpu_check.json]

The measuring stages (1-7) need only torch and transformers (no Ray, vLLM, DeepSpeed,
nothing downloaded); the stages after them (8-12) each need one optional package and are
skipped, saying so, where it is absent. The models
are built from a ``Qwen2Config`` with Qwen2.5(-Math)-1.5B's / -7B's shape and random
weights, and the project's own functions are imported from the repository this file lives
in (no install needed). The stages, run in this order on one device (``--stages`` picks a
subset):

1. ``learner``: one optimiser step of this project's learner on one GPU's share of the
   official 1.5B recipe: 8 rows x (1024 prompt + 1024 or 3072 response) tokens, i.e.
   16k / 32k tokens, the official run's ``ppo_max_token_len_per_gpu`` of 32768
   (ExGRPO/exp_scripts/run_exgrpo.sh). A step is what ``ExGRPOTorchLearner`` does:
   ``core.scoring.score_learner_batch`` (log-probs + entropy of the completion tokens,
   through the LM head in chunks of ``logit_chunk_tokens``' default, 512 positions),
   ``core.losses.mixed_policy_loss`` as in mixed mode (half the rows
   replayed and shaped, fresh rows unclipped, the official aggregation, entropy 0.001),
   backward, grad-norm clip 1.0, AdamW (lr 1e-6, weight decay 0.01). Prompts are
   left-padded and responses right-padded to random lengths (one row full), as the
   learner batch is. With and without gradient checkpointing; tokens/s (all positions
   computed, and real tokens only) and peak memory (``torch.cuda.max_memory_allocated``).
   ``param_update_fraction``: the share of weight elements one lr-1e-6 AdamW step changes
   at this dtype (bf16 weights round most such updates away: the learner needs fp32
   master weights). The no-grad scoring pass (what an env runner does to recompute
   behaviour log-probs or to pick the lowest-entropy replay trajectory) is timed on the
   same batch. These passes are padded (``--attn``, sdpa by default); the packed pass
   the learner runs under ``learner_micro_batch_tokens`` is the next stage.
2. ``packed``: one packed learner pass at the real vocabulary on a Qwen2.5-Math-1.5B-shaped
   slice (hidden 1536, 12 heads, 2 kv heads, intermediate 8960, vocab 151936, tied
   embeddings) with 2 of its 28 decoder layers, bf16 weights, gradient checkpointing as
   tuned_examples/exgrpo_qwen1.5b.yaml has it: its ``learner_micro_batch_tokens`` (32768)
   as 8 rows x (1024 + 3072) tokens laid end to end (``core.packing.pack_rows``), positions
   restarting per row, under the kernel the learner resolves
   (``core.attention.resolve_attn_implementation("auto", device)`` after
   ``register_kernels()``: flash_attention_2 where ``flash_attn`` imports, else the
   project's ``sdpa_varlen``; whether ``flash_attn`` imported is reported), scored by
   ``core.packing.score_packed`` (log-probs + entropy in chunks of the default 512
   positions, recomputed in backward), ``mixed_policy_loss`` as the learner stage,
   backward (gradients already allocated, as under gradient accumulation). The peak beyond
   what was allocated before the pass (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats`` minus ``memory_allocated`` before; on CPU the peak of live
   tensor bytes from ``torch.profiler``'s memory events, as benchmarks/memory_plan.py) is
   set against the memory plan's ``learner_activation_breakdown(...)["peak"]`` for the
   same pass (rows 1, its tokens, its scored positions, ``dense_mask=False``, bf16,
   checkpointing, default chunk): ``measured_over_planned``; pass time (the second, warm
   pass; the first is reported too) and tokens/s.
3. ``drift``: bf16 log-prob drift. The same rows (4 x (1024 + 8192), the 7B recipe's
   micro-batch) scored in other batch compositions than the learner's padded batch: the
   same batch again, each row alone without padding, rows reversed with wider padding.
   Max and mean |delta log p| over the real completion tokens, and max |exp(delta) - 1|:
   the error it puts into ExGRPO's unclipped importance ratio of fresh rows in mixed mode.
   Run on the full-depth 1.5B model and on the deepest 7B slice below.
4. ``slice``: a bf16 learner step of a Qwen2.5-Math-7B-shaped slice (hidden 3584, 28
   heads, 4 kv heads, intermediate 18944, vocab 152064, untied embeddings) with only 2 and
   4 of its 28 decoder layers, at the 7B recipe's micro-batch (``learner_micro_batch_rows``
   4 x (1024 + 8192) tokens, tuned_examples/exgrpo_qwen.yaml), gradient checkpointing on.
   Weights as DeepSpeed's bf16 mode keeps them: a bf16 module (bf16 forward, backward and
   gradients) and an fp32 master copy with AdamW's moments in the optimiser, here for the
   slice's own parameters, on one device, unsharded: ``state_bytes`` is 14 B/param (2
   weights + 4 master + 8 moments); bf16 gradients (2 B/param) live during backward, fp32
   master gradients (4 B/param) during the optimiser step. Forward + backward and the
   optimiser step are timed and their peaks (minus what was allocated before the slice)
   taken separately. Every per-depth figure is fitted as fixed part (embeddings, LM head,
   logits, loss) + per-layer part and evaluated at 28 layers: peak memory, state, step
   time, tokens/s, no-grad scoring time; the parameter count, exactly linear in depth,
   checks the fit against the full model's (7,615,616,512). The memory plan
   (``rllib_exgrpo.planning``: ``model_state_bytes``, ``learner_activation_bytes``) is
   set next to the measurement at each depth, at 28 layers, and per GPU as the recipe
   runs (its learner backend, ZeRO stage and learner count); ``plan: unavailable (...)``
   where that module cannot be imported.
5. ``transfer``: host <-> GPU copies of 7B-sized bf16 state (15.2 GB: 7.6 G parameters
   x 2 bytes) in 512 MB chunks, from pinned and from pageable host memory, both
   directions: seconds, GB/s, bytes moved, a round-trip check of the data, and seconds
   per 15.2 GB. Sized down to 40% of the free host RAM and 80% of the free GPU memory,
   to what the budget allows (predicted from one probed chunk), and on a CPU run (host to
   host, pageable only) to 0.25 GB.
6. ``generation``: ``model.generate`` under the HF backend's neutral sampling config
   (temperature 1, top-p 1, no top-k) and the backend's own ``pruned_decode`` loop,
   batch 64 and 256 x (256 prompt + 512 new tokens), no stop token (every row runs to
   512). New tokens/s and peak memory.
7. ``colocate``: the colocated cycle (``colocate: true``, rllib/colocation.py) on one device,
   with the full 1.5B model as the DDP learner holds it: fp32 weights and AdamW (lr 1e-6,
   weight decay 0.01, clip 1.0) computing under bf16 autocast (``--dtype float32``: no
   autocast), gradient checkpointing; the learner stage's helpers at 8 x (1024 + 1024).
   Phases, each with its peak (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats``) and what stays allocated after it, both above the stage's
   start: (1) ``learner``: one step (its gradients kept, as the learner leaves them);
   (2) ``release``: gradients set to None, the optimizer state to pinned host memory with
   the product's ``OptimizerOffload``, ``empty_cache``; (3) ``generation``: ``generate``
   (sampling, 64 prompts x (256 + 128 new tokens)) from the same model object, eval mode,
   no grad, under the learner's autocast; (4) ``restore``: the state reloaded, a second
   step. Next to each, the memory plan's figure for the same shapes
   (``planning.memory.plan_memory`` of a one-GPU DDP learner with ``colocate: true`` and the
   HF backend, less the CUDA context the allocator does not see): the ``learner`` entry for
   (1) and (4), the ``generation turn (colocate)`` entry's learner weights for (2)'s
   resident bytes, and that entry less its optimizer state (offloaded here; the plan keeps
   it for the HF turn, printed too) for (3); ``within_plan``. The round trip is checked:
   every state tensor on the host (pinned) during the turn and back on its device after,
   bitwise equal to a copy taken before the offload; the weights bitwise unchanged by the
   turn; and the second step equal, bitwise, to the same step replayed from that copy (the
   same gradients, the same optimizer): ``round_trip_ok``. About a minute on an H100
   (~25 GB of state; ~37 GB of host memory for the pinned state and the reference copies).
   On CPU (``--shape tiny``) the cycle runs at a tiny shape; memory figures are
   ``unavailable``, and the state is copied into new host tensors and back.
8. ``zero3-colocate-offload`` (needs ``deepspeed``; ``--wheels`` installs it): a one-rank
   DeepSpeed engine (gloo on CPU, NCCL on a GPU; the group made as the project's DeepSpeed
   learner makes one for a local learner, no Ray) over a small Qwen2 with the learner's
   optimizer (``torch.optim.AdamW``), one step, then the colocated turn's offload with the
   product's ``rllib_exgrpo.rllib.optimizer_offload.OptimizerOffload`` (bytes moved per
   state kind, set against the plan's ``optimizer`` term of ``model_state_bytes``), a check
   that the compute-dtype weights the next push reads (``lp_params``) neither moved nor
   changed, the reload, a second step, and the optimizer state, fp32 partitions and
   weights compared bit for bit with a reference run without the offload; for each ZeRO
   stage of ``--zero-stages`` (1, 2, 3).
9. ``nccl-broadcast`` (needs ``ray``: ``weight_broadcast.learner_open`` and
   ``RunnerEnd.join`` ask Ray for the node's address, and the learner's tensors come
   through RLlib's ``InferenceOnlyAPI``): the project's collective weight broadcast
   (``rllib/weight_broadcast.py``: the layout, the group, the check-ins, ``learner_send``,
   ``RunnerEnd.receive``) from this process (the root) into a model in a second process
   (``torch.multiprocessing``), which then holds the root's weights bit for bit; NCCL where
   the root and the receiver each have a GPU of their own (NCCL takes one GPU per rank),
   gloo otherwise, as the product picks.
10. ``packed-flash`` (needs a GPU and ``flash_attn``): the packed stage's pass under
    ``flash_attention_2``, no fallback kernel; its peak against the same plan term.
11. ``vllm-reload`` (needs ``vllm``; runs on vLLM's CPU build too): a vLLM engine through
    the project's ``VLLMGenerationBackend`` over a model made here (a Qwen2 at the real
    vocabulary, 151936, two small layers, random weights, the project's rehearsal
    tokenizer: ``models/rehearsal.py``), the learner's weights (perturbed, so the engine
    must take them) pushed with the colocated sampler's ``push_weights``, prompt
    log-probs against HF's on the same weights within a tolerance, and vLLM's warnings
    during the push counted (must be 0).
12. ``vllm-sleep-wake`` (needs ``vllm`` on a GPU: vLLM's CPU build has no sleep mode):
    the engine built with ``enable_sleep_mode``, generate, ``sleep(level=2)``,
    ``wake_up(tags=["weights"])``, the push, ``wake_up(tags=["kv_cache"])``, generate
    again, prompt log-probs against HF's; the GPU memory in use awake and asleep against
    the plan's terms (the engine's ``gpu_memory_utilization`` share; the sleeping
    engine's residue, ``SLEEPING_ENGINE_SHARE``).

Every run ends with a table of stages (stage | status | seconds | note: ran, skipped and
why, or failed with the error in one line) and exits non-zero when a stage failed.
``--cpu`` runs every stage a CPU allows at the tiny shape (``--shape tiny --device cpu``).

Every stage is timed and printed; a stage whose predicted time (from what the earlier
stages measured: the learner's FLOP rate and scoring rate, the packed stage's no-grad
pass, a probe chunk, a short generation) would exceed the budget (``--budget-s``, 420 s:
the whole check stays under 8 minutes on one 80 GB GPU; the expected time of the stages
8-12 that can run here is kept back from stages 1-7) is skipped with the reason, or cut to
fewer steps / fewer passes / fewer bytes.
The JSON (``--out``) is rewritten after every stage, so a killed run still leaves what it
measured. ``--shape tiny`` runs every stage at a tiny shape on CPU (tests): a 2-layer
model (vocabulary 512), a packed pass of 6 x (32 + 96) tokens at that shape, a 1- and
"""
