"""Callbacks that watch a run without changing it, for tests and benchmarks that run a script's main as it is: each
event is a list the caller appends functions to before the run starts.

    draw(indices)          the prompts an update draws (this process's share; again for each dynamic-sampling round)
    episodes(tokens, policy)  --environment: each row's episode tokens, and which the policy sampled, as
                           utils.episodes made them (before they become the Batch's tensors)
    batch(sampler, batch)  each update's Batch as sampled and scored (with --max_staleness: as sampled, on the sampler
                           thread; its scores and behaviour logprobs are filled in by the scorer afterwards)
    step(run, model)       after each micro-batch's optimiser call (run.accelerator.sync_gradients: a real step)
"""

WATCH = {"draw": [], "episodes": [], "batch": [], "step": []}


def notify(event, *args):
    for fn in WATCH[event]:
        fn(*args)
