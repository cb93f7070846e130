"""qerl-plugin core: the NVFP4 codec, the AQN noise schedule and the ``qerl`` CLI.

Imports neither vLLM nor verl. The data path:

* ``qerl_plugin.nvfp4``     E2M1/FP8 codec, bit-compatible with compressed-tensors ``nvfp4-pack-quantized``
* ``qerl_plugin.format``    the NVFP4A16 ``quantization_config`` (built from compressed-tensors' own classes)
* ``qerl_plugin.aqn``       the AQN sigma schedule and the per-norm noise vectors, the same in vLLM and the actor
* ``qerl_plugin.source``    ``qerl quantize``'s input: a local directory or a Hub id, its config and tensor headers
* ``qerl_plugin.plan``      what each tensor becomes (quantized, kept, why), read from the headers; ``--dry-run``
* ``qerl_plugin.shards``    the output's files (huggingface_hub's shard split) and index
* ``qerl_plugin.quantize``  streaming HF checkpoint -> NVFP4A16 checkpoint; ``quantize_cli`` is ``qerl quantize``
* ``qerl_plugin.options``   names shared by the packages (method, format, engine options), one bool parser
* ``qerl_plugin.upstream``  every vLLM/verl name qerl wraps, overrides or reads, with the pinned versions
* ``qerl_plugin.evaluate``  ``qerl eval``: greedy pass@1 and sampled pass@k; ``evaluate_inputs`` checks the data,
                            model and adapter, ``evaluate_metrics`` scores, ``evaluate_hf`` is the transformers backend
* ``qerl_plugin.plot``      ``qerl plot``: training curves from verl's ``metrics.jsonl`` files
* ``qerl_plugin.sampler``   ``QERL_PROFILE_DIR``: a wall-clock sampling profiler in every verl and vLLM process
* ``qerl_plugin.doctor``    environment report (``qerl doctor``)
* ``qerl_plugin.notices``   warnings logged once per process, shared by the vLLM and verl extensions
* ``qerl_plugin.gpu_clocks`` nvidia-smi samples of the GPU's clocks around a timed run: did it slow itself down?
* ``qerl_plugin.cli``       the ``qerl`` command

``vllm_ext`` (rollout side) and ``verl_ext`` (trainer side) build on these.
"""

__version__ = "0.1.0"
