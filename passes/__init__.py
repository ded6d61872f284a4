"""Passes: the planned program, one transformation per file, run in order by ``manager``.

    decompose_loss, fold_noops, dead_code        clean up the captured step
    functionalize_writes                         writes through views made out of place
    clip_grad, lower_optimizer                   gradient clipping and the optimizer's updates
    vocab_parallel_loss                          log_softmax decomposed where classes may shard
    sync_batch_norm                              batch norm's statistics all-reduced under dp
    settle_mesh                                  the mesh and pipeline the program runs on
    pin_annotations, tensor_parallel_plan,       the placements the user gave (shard_tensor,
      sequence_parallel, shard_batch               the tp plan, Megatron-SP, the batch)
    split_stages                                 each forward/backward op's pipeline stage
    regroup_flattens                             where a reshape may keep a merged shard
    completion                                   a placement for every value (SPMD rules)
    merge_gradients                              gradients accumulated over k batches
    reshard                                      communication where placements differ
    bucket_collectives, join_gradients           fewer, larger, asynchronous collectives
    assign_phases, schedule_pipeline             a pipeline's phases and job order

Besides the passes: ``context`` (the inputs and the typed facts passes hand on),
``parallel_layout`` (the strategy interpreted), ``pinning`` (how annotation passes place
values), ``explain`` (why a value has its placement). Each rank's program is made from the
result by ``autopar.lower``.
"""
