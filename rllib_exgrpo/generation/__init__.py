"""Generation backends: the env runner samples completions through one of them.

* :mod:`rllib_exgrpo.generation.base`: the backend interface, sampling parameters and the
  names of the backends;
* :mod:`rllib_exgrpo.generation.hf`: transformers (the CPU default), sampling from the
  runner's own module;
* :mod:`rllib_exgrpo.generation.vllm`: vLLM (the GPU extra), its weights pushed after each sync;
* :mod:`rllib_exgrpo.generation.sample_and_score`: sampling plus the learner's scoring.

A package of its own (not a namespace folder), so that a wheel built from the repository
carries it.
"""
