"""Multi-process inference with torch.distributed: attention data parallel (dp), MoE expert
parallel (ep) and the prefill/decode (PD) hand-off.

    parallel_config.py   dp / tp / moe_ep / timeout from config.json or keywords, validated
    parallel_state.py    this process's rank and process groups (one ParallelContext per process)
    launch.py            spawned local ranks (LLM(...), `mindspec serve`) or torchrun's env vars
    control.py           rank 0 -> other ranks: the engine commands of each step (gloo broadcast)
    spmd_engine.py       every rank runs the same engine on the same request stream
    worker.py            the entry point of a spawned rank (`python -m mindspec.distributed.worker`)
    dp_plan.py           which rank keeps which sequence; this rank's padded share of a batch
    dp_gather.py         logits / hidden states / drafts gathered back in request order
    expert_parallel.py   this rank's routed experts; all-gather dispatch, reduce-scatter combine
    pd_transfer.py       a PrefillHandoff (first token + prompt KV) as bytes and back
"""
