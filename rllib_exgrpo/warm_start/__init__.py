"""The tiny model's supervised warm start: the build of a tiny model folder from its recipe.

``models`` holds the tiny model's recipe, tokenizer, cache and shipped copies, and starts a
build as a child process with pinned numerics (``models.pinned_build``); this package is
what that child runs (:mod:`rllib_exgrpo.warm_start.pinned_child`). It sits above
``generation`` (its held-out checks sample through the project's one sample-and-score path)
and ``xrpo`` (its in-context examples come from XRPO's retrieval).

- :mod:`~rllib_exgrpo.warm_start.build`: tokenizer, model, warm start and report into a folder
- :mod:`~rllib_exgrpo.warm_start.training`: the supervised steps and the stopping rule
- :mod:`~rllib_exgrpo.warm_start.examples`: the solutions a recipe shows, and their ids
- :mod:`~rllib_exgrpo.warm_start.in_context`: in-context prefixes (XRPO's retrieval)
- :mod:`~rllib_exgrpo.warm_start.pass1`: held-out pass@1 and the figures a recipe stops on
- :mod:`~rllib_exgrpo.warm_start.progress`: the progress bar or lines
- :mod:`~rllib_exgrpo.warm_start.pinned_child`: the build's child process entry point
"""
