"""Every vLLM and verl name qerl depends on, in one table, with the versions it targets.

:data:`SURFACE` lists what ``vllm_ext`` and ``verl_ext`` wrap, override, subclass, swap, call or read
privately, as dotted strings (``module:qualname``, the form :func:`pkgutil.resolve_name` reads), so this
module imports neither vLLM nor verl. :mod:`verl_ext.patches` applies the ``wraps`` entries;
``tests/qerl_plugin/test_upstream.py`` resolves every entry against the installed packages and checks the
parameters and attributes it declares, so an upstream change fails CI instead of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "MARLIN_FP4_MIN_CAPABILITY", "PINS", "SURFACE", "Upstream", "VERL_VERSION", "VLLM_VERSION", "wrapped"]

VLLM_VERSION = "0.24.0"
VERL_VERSION = "0.9.1"
# Versions qerl is tested with (``qerl doctor`` warns about others).
PINS = {
    "torch": "2.11.0",
    "vllm": VLLM_VERSION,
    "verl": VERL_VERSION,
    "compressed-tensors": "0.17.0",
    "transformers": "5.9.0",
    "peft": "0.21.2",
}
# vLLM's Marlin FP4 (W4A16) kernel: ``is_fp4_marlin_supported()`` is CUDA with capability >= 7.5.
MARLIN_FP4_MIN_CAPABILITY = (7, 5)

# How qerl uses a name:
#   wraps       replaced at import by a wrapper that calls the original (verl_ext.patches applies these)
#   swaps       replaced for the duration of one call, then restored
#   overrides   a method qerl's subclass redefines (it must keep the upstream signature)
#   subclasses  a class qerl derives from
#   private     an underscore name qerl calls, shadows or reads
#   calls       a public function or class qerl calls with the parameters listed
KINDS = ("wraps", "swaps", "overrides", "subclasses", "private", "calls")


@dataclass(frozen=True)
class Upstream:
    """One upstream name.

    ``target``: ``"module:Qualified.name"``. ``kind``: one of :data:`KINDS`. ``user``: the qerl module that
    uses it. ``params``: the first parameters of the resolved callable, in order (qerl passes them by
    position or overrides with them). ``keywords``: parameters qerl passes by name. ``attrs``: attributes qerl
    reads on instances, which the class (or a base) must assign. ``wrapper``: for ``wraps``/``swaps``, qerl's
    factory (``wraps``: ``factory(original, target)`` returns the wrapper) or context manager.
    """

    target: str
    kind: str
    user: str
    why: str
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    wrapper: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.target}: kind {self.kind!r} is not one of {KINDS}")
        if ":" not in self.target:
            raise ValueError(f"{self.target}: expected 'module:qualname'")
        if (self.kind in ("wraps", "swaps")) != bool(self.wrapper):
            raise ValueError(f"{self.target}: a wrapper goes with kind wraps or swaps, and only there")

    @property
    def package(self) -> str:
        return self.target.split(".", 1)[0]

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


# ---------------------------------------------------------------------------------------------------------
# vLLM

_Q = "vllm.model_executor.layers.quantization"
_QC = f"{_Q}.base_config:QuantizationConfig"
_CT = f"{_Q}.compressed_tensors"
_LIN = "vllm.model_executor.layers.linear"
_MARLIN = f"{_Q}.utils"
_NORM = "vllm.model_executor.layers.layernorm:RMSNorm"
_LORA = "vllm.lora"
_LOAD_ATTRS = ("input_size", "output_size", "params_dtype", "skip_bias_add", "quant_config", "prefix", "tp_size",
               "tp_rank", "input_size_per_partition", "output_size_per_partition", "output_sizes")

_VLLM: tuple[Upstream, ...] = (
    # the quantization method (vllm_ext.quant, vllm_ext.nvfp4_linear)
    Upstream(f"{_Q}:QUANTIZATION_METHODS", "calls", "vllm_ext.quant", "is 'nvfp4' registered"),
    Upstream(f"{_Q}:register_quantization_config", "calls", "vllm_ext.quant", "register 'nvfp4'",
             params=("quantization",)),
    Upstream(f"{_Q}:_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", "private", "vllm_ext.quant",
             "which class holds 'nvfp4' (register() is idempotent and warns about a foreign one)"),
    Upstream(_QC, "subclasses", "vllm_ext.quant", "NVFP4Config", attrs=("packed_modules_mapping",)),
    Upstream(f"{_QC}.get_name", "overrides", "vllm_ext.quant", "NVFP4Config", params=("self",)),
    Upstream(f"{_QC}.get_supported_act_dtypes", "overrides", "vllm_ext.quant", "NVFP4Config", params=("self",)),
    Upstream(f"{_QC}.get_min_capability", "overrides", "vllm_ext.quant", "NVFP4Config"),
    Upstream(f"{_QC}.get_config_filenames", "overrides", "vllm_ext.quant", "NVFP4Config (empty: BF16 checkpoints)"),
    Upstream(f"{_QC}.from_config", "overrides", "vllm_ext.quant", "NVFP4Config", params=("config",)),
    Upstream(f"{_QC}.override_quantization_method", "overrides", "vllm_ext.quant",
             "claim an NVFP4A16 checkpoint under --quantization nvfp4", params=("hf_quant_cfg", "user_quant", "hf_config")),
    Upstream(f"{_QC}.apply_vllm_mapper", "overrides", "vllm_ext.quant", "map ignore entries to vLLM names",
             params=("self", "hf_to_vllm_mapper")),
    Upstream(f"{_QC}.get_quant_method", "overrides", "vllm_ext.quant", "dispatch to nvfp4_linear",
             params=("self", "layer", "prefix")),
    Upstream(f"{_Q}.base_config:QuantizeMethodBase.uses_meta_device", "calls", "vllm_ext.nvfp4_linear",
             "BF16 sources create their weight on the meta device (vLLM's online-quantization path)"),
    Upstream(f"{_CT}.compressed_tensors:CompressedTensorsConfig.from_config", "calls", "vllm_ext.quant",
             "the NVFP4A16 checkpoint's own config, reused", params=("config",)),
    Upstream(f"{_CT}.compressed_tensors:CompressedTensorsConfig.get_scheme_dict", "calls", "vllm_ext.nvfp4_linear",
             "is this layer quantized in the checkpoint", params=("self", "layer", "layer_name")),
    Upstream(f"{_CT}.compressed_tensors:CompressedTensorsConfig.get_quant_method", "calls", "vllm_ext.nvfp4_linear",
             "KV cache, MoE, quantized embeddings stay vLLM's", params=("self", "layer", "prefix")),
    Upstream(f"{_CT}.compressed_tensors:CompressedTensorsConfig.apply_vllm_mapper", "calls", "vllm_ext.quant",
             "NVFP4Config.apply_vllm_mapper", params=("self", "hf_to_vllm_mapper")),
    Upstream(f"{_CT}.compressed_tensors:CompressedTensorsConfig", "calls", "vllm_ext.nvfp4_linear",
             "its ignore list and KV-cache scheme", attrs=("ignore", "kv_cache_scheme", "packed_modules_mapping")),
    Upstream(f"{_CT}.utils:should_ignore_layer", "calls", "vllm_ext.nvfp4_linear",
             "ignore entries of a BF16 source, compressed-tensors' rule with fused layers",
             params=("layer_name", "ignore", "fused_mapping")),
    Upstream(f"{_LIN}:LinearMethodBase", "subclasses", "vllm_ext.nvfp4_linear", "QerlNVFP4LinearMethod"),
    Upstream(f"{_LIN}:LinearMethodBase.create_weights", "overrides", "vllm_ext.nvfp4_linear", "QerlNVFP4LinearMethod",
             params=("self", "layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size",
                     "params_dtype")),
    Upstream(f"{_LIN}:LinearMethodBase.process_weights_after_loading", "overrides", "vllm_ext.nvfp4_linear",
             "QerlNVFP4LinearMethod", params=("self", "layer")),
    Upstream(f"{_LIN}:LinearMethodBase.apply", "overrides", "vllm_ext.nvfp4_linear", "QerlNVFP4LinearMethod",
             params=("self", "layer", "x", "bias")),
    Upstream(f"{_LIN}:register_weight_loader_v2_supported_method", "calls", "vllm_ext.nvfp4_linear",
             "QerlNVFP4LinearMethod takes weight_loader_v2", params=("cls",)),
    Upstream(f"{_LIN}:LinearBase", "calls", "vllm_ext.nvfp4_linear", "which layers get the method"),
    Upstream(f"{_LIN}:UnquantizedLinearMethod", "calls", "vllm_ext.nvfp4_linear", "ignored layers stay BF16"),
    Upstream(f"{_LIN}:QKVParallelLinear", "calls", "vllm_ext.nvfp4_load", "part names and checkpoint shapes",
             attrs=_LOAD_ATTRS + ("total_num_heads", "head_size", "total_num_kv_heads", "v_head_size", "num_kv_head_replicas")),
    Upstream(f"{_LIN}:MergedColumnParallelLinear", "calls", "vllm_ext.nvfp4_load", "part names and checkpoint shapes",
             attrs=("output_sizes",)),
    Upstream(f"{_LIN}:ReplicatedLinear", "calls", "vllm_ext.nvfp4_load", "not split over tensor-parallel ranks"),
    Upstream("vllm.model_executor.parameter:BasevLLMParameter.weight_loader", "swaps", "vllm_ext.nvfp4_reload",
             "an installed layer's kernel tensors get loaders that stage, quantize and copy a base-weight reload "
             "into the same buffers (vLLM's loaders call param.weight_loader)",
             wrapper="vllm_ext.nvfp4_reload:attach_reload_loaders"),
    Upstream(f"{_LIN}:QKVParallelLinear.weight_loader", "calls", "vllm_ext.nvfp4_load",
             "the layer's loader, wrapped with tensor checks (checked_loader) and called on staged/raw copies",
             params=("self", "param", "loaded_weight", "loaded_shard_id")),
    Upstream(f"{_LIN}:MergedColumnParallelLinear.weight_loader", "calls", "vllm_ext.nvfp4_reload",
             "the bias reload calls the class's loader on a raw copy",
             params=("self", "param", "loaded_weight", "loaded_shard_id")),
    Upstream(f"{_LIN}:QKVParallelLinear.weight_loader_v2", "calls", "vllm_ext.nvfp4_load",
             "the loader vLLM passes to create_weights", params=("self", "param", "loaded_weight", "loaded_shard_id")),
    Upstream(f"{_LIN}:MergedColumnParallelLinear.weight_loader_v2", "calls", "vllm_ext.nvfp4_load",
             "the loader vLLM passes to create_weights", params=("self", "param", "loaded_weight", "loaded_shard_id")),
    Upstream("vllm.model_executor.parameter:ModelWeightParameter", "calls", "vllm_ext.nvfp4_linear",
             "checkpoint-format tensors"),
    Upstream("vllm.model_executor.parameter:GroupQuantScaleParameter", "calls", "vllm_ext.nvfp4_linear",
             "weight_scale"),
    Upstream("vllm.model_executor.parameter:PerTensorScaleParameter", "calls", "vllm_ext.nvfp4_linear",
             "weight_global_scale"),
    Upstream("vllm.model_executor.model_loader.reload.layerwise:initialize_online_processing", "private",
             "vllm_ext.nvfp4_linear", "a meta-device BF16 layer is processed as soon as its shards loaded",
             params=("layer",)),
    Upstream("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "calls", "vllm_ext.nvfp4_reload",
             "layerwise reload restores the checkpoint-format tensors (tested)", params=("model",)),
    Upstream("vllm.model_executor.model_loader.reload:finalize_layerwise_reload", "calls", "vllm_ext.nvfp4_reload",
             "layerwise reload copies into the installed kernel tensors (tested)"),
    Upstream("vllm.model_executor.layers.attention:Attention", "calls", "vllm_ext.nvfp4_linear",
             "plain attention when the checkpoint has no KV-cache scheme"),
    Upstream("vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts", "calls", "vllm_ext.nvfp4_linear",
             "MoE experts of a BF16 source stay BF16 (matched by class name)"),
    Upstream("vllm.config:get_current_vllm_config", "calls", "vllm_ext.nvfp4_backends",
             "additional_config['qerl_nvfp4'] and the load format of the engine being built"),
    Upstream("vllm.config:VllmConfig", "calls", "vllm_ext.noisy_norm", "per-engine options",
             attrs=("additional_config", "load_config", "model_config")),
    Upstream("vllm.distributed:get_tp_group", "calls", "vllm_ext.nvfp4_load", "all-reduce a fused layer's amax"),
    Upstream("vllm.platforms:current_platform", "calls", "vllm_ext.nvfp4_backends", "CUDA and its capability"),
    Upstream(f"{_MARLIN}.marlin_utils_fp4:prepare_fp4_layer_for_marlin", "calls", "vllm_ext.nvfp4_backends",
             "repack the NVFP4 triple for Marlin", params=("layer",)),
    Upstream(f"{_MARLIN}.marlin_utils_fp4:apply_fp4_marlin_linear", "calls", "vllm_ext.nvfp4_backends",
             "the GEMM", keywords=("input", "weight", "weight_scale", "weight_global_scale", "workspace", "size_n",
                                   "size_k", "bias", "use_fp32_reduce")),
    Upstream(f"{_MARLIN}.marlin_utils:marlin_permute_bias", "calls", "vllm_ext.nvfp4_backends", "reloaded bias"),
    Upstream(f"{_MARLIN}.marlin_utils:marlin_pad_dim", "calls", "vllm_ext.nvfp4_backends", "reloaded bias",
             params=("x", "size", "padded")),
    Upstream(f"{_MARLIN}.marlin_utils:marlin_padded_nk", "calls", "vllm_ext.nvfp4_backends", "reloaded bias",
             params=("size_n", "size_k", "group_size")),
    Upstream("vllm.model_executor.models.utils:WeightsMapper._map_name", "private", "vllm_ext.noisy_norm",
             "vLLM <-> HF module names (also vllm_ext.quant's ignore entries)", params=("self", "key")),
    Upstream("vllm.model_executor.models.utils:WeightsMapper", "calls", "vllm_ext.noisy_norm",
             "inverted to name norms as the trainer does", attrs=("orig_to_new_prefix", "orig_to_new_substr")),
    # AQN (vllm_ext.noisy_norm)
    Upstream(_NORM, "subclasses", "vllm_ext.noisy_norm", "NoisyRMSNorm",
             attrs=("name", "weight", "variance_epsilon", "variance_size_override")),
    Upstream(f"{_NORM}.__init__", "overrides", "vllm_ext.noisy_norm", "NoisyRMSNorm",
             params=("self", "hidden_size", "eps", "var_hidden_size", "has_weight", "dtype")),
    Upstream(f"{_NORM}.forward_native", "overrides", "vllm_ext.noisy_norm", "NoisyRMSNorm", params=("self", "x", "residual")),
    Upstream(f"{_NORM}.forward_cuda", "overrides", "vllm_ext.noisy_norm", "NoisyRMSNorm", params=("self", "x", "residual")),
    Upstream(f"{_NORM}.register_oot", "calls", "vllm_ext.noisy_norm", "RMSNorm(...) anywhere in vLLM builds NoisyRMSNorm"),
    Upstream("vllm.model_executor.custom_op:op_registry_oot", "calls", "vllm_ext.noisy_norm",
             "is RMSNorm already replaced out of tree"),
    Upstream("vllm.config:get_current_vllm_config_or_none", "calls", "vllm_ext.noisy_norm",
             "additional_config['qerl_aqn'] of the engine being built"),
    # worker RPCs and in-memory LoRA (vllm_ext.worker_extension)
    Upstream("vllm.v1.worker.gpu_worker:Worker", "calls", "vllm_ext.worker_extension",
             "the worker the extension is mixed into", attrs=("model_runner", "rank", "device")),
    Upstream("vllm.v1.worker.gpu_worker:Worker.list_loras", "calls", "verl_ext.worker_extension",
             "the adapter is registered after a sync", params=("self",)),
    Upstream("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "calls", "vllm_ext.worker_extension",
             "the model and the LoRA manager", attrs=("lora_manager", "get_model")),
    Upstream(f"{_LORA}.worker_manager:LRUCacheWorkerLoRAManager", "private", "vllm_ext.worker_extension",
             "where an in-memory adapter goes; _adapter_manager holds the LoRA modules vLLM built (also read by "
             "verl_ext.worker_extension)", attrs=("_adapter_manager", "lora_config", "max_position_embeddings", "vocab_size")),
    Upstream(f"{_LORA}.worker_manager:LRUCacheWorkerLoRAManager._load_adapter", "private", "vllm_ext.worker_extension",
             "shadowed on the instance for one add_adapter call, which then loads the in-memory adapter",
             params=("self", "lora_request")),
    Upstream(f"{_LORA}.worker_manager:LRUCacheWorkerLoRAManager.add_adapter", "calls", "vllm_ext.worker_extension",
             "LRU eviction, in-place replacement, activation", params=("self", "lora_request")),
    Upstream(f"{_LORA}.worker_manager:WorkerLoRAManager.list_adapters", "calls", "vllm_ext.worker_extension",
             "qerl_memory_report", params=("self",)),
    Upstream(f"{_LORA}.model_manager:LoRAModelManager", "calls", "vllm_ext.worker_extension",
             "the modules vLLM wrapped with LoRA (also verl_ext.adapter_sync)", attrs=("modules", "packed_modules", "model")),
    Upstream(f"{_LORA}.lora_model:LoRAModel.from_lora_tensors", "calls", "vllm_ext.worker_extension", "build the adapter",
             keywords=("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size",
                       "weights_mapper", "skip_prefixes")),
    Upstream(f"{_LORA}.lora_model:LoRAModel._should_skip_module", "private", "vllm_ext.worker_extension",
             "the tensors vLLM skips (also verl_ext.adapter_sync)", params=("module_name", "skip_prefixes")),
    Upstream(f"{_LORA}.peft_helper:PEFTHelper.from_dict", "calls", "vllm_ext.worker_extension", "the adapter's config",
             params=("config_dict",)),
    Upstream(f"{_LORA}.peft_helper:PEFTHelper.validate_legal", "calls", "vllm_ext.worker_extension",
             "rank and options this engine serves", params=("self", "lora_config")),
    Upstream(f"{_LORA}.request:LoRARequest", "calls", "vllm_ext.worker_extension", "the request add_adapter takes",
             keywords=("lora_name", "lora_int_id", "lora_path", "load_inplace")),
    Upstream(f"{_LORA}.utils:parse_fine_tuned_lora_name", "calls", "vllm_ext.worker_extension",
             "adapter tensor -> module (also verl_ext.adapter_sync)", params=("name", "weights_mapper")),
    Upstream(f"{_LORA}.utils:is_base_embedding_weights", "calls", "vllm_ext.worker_extension",
             "tensors LoRA loading skips (also verl_ext.adapter_sync)", params=("name",)),
    Upstream(f"{_LORA}.utils:get_supported_lora_modules", "calls", "vllm_ext.worker_extension",
             "the LoRA table without a live manager", params=("model",)),
    Upstream(f"{_LORA}.utils:is_in_target_modules", "calls", "vllm_ext.worker_extension", "the LoRA table",
             params=("module_name", "target_modules", "packed_modules_mapping")),
    Upstream(f"{_LORA}.utils:is_supported_lora_module", "calls", "vllm_ext.worker_extension", "the LoRA table",
             params=("module_name", "supported_lora_modules")),
    Upstream(f"{_LORA}.utils:process_packed_modules_mapping", "calls", "vllm_ext.worker_extension", "the LoRA table",
             params=("model",)),
    Upstream("vllm.model_executor.models.utils:PPMissingLayer", "calls", "vllm_ext.worker_extension",
             "layers of other pipeline stages"),
    # dense single-adapter LoRA (vllm_ext.lora_dense)
    Upstream(f"{_LORA}.punica_wrapper.punica_gpu:PunicaWrapperGPU", "subclasses", "vllm_ext.lora_dense_wrapper",
             "QerlPunicaWrapper", attrs=("max_loras", "_token_lora_indices")),
    Upstream(f"{_LORA}.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_linear", "overrides", "vllm_ext.lora_dense_wrapper",
             "one adapter as two dense GEMMs per slice",
             params=("self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices"), keywords=("buffer",)),
    Upstream(f"{_LORA}.layers.column_parallel_linear:_mcp_apply", "private", "vllm_ext.lora_dense_wrapper",
             "shadowed by route_merged_layers: merged q/k/v and gate/up layers take add_lora_linear (or, in the "
             "overlap mode, qerl::linear_lora_overlap)", params=("x", "bias", "layer")),
    Upstream(f"{_LORA}.layers.base_linear:BaseLinearLayerWithLoRA.apply", "private", "vllm_ext.lora_dense_wrapper",
             "replaced on the class by route_merged_layers: in the overlap mode o_proj/down_proj run "
             "qerl::linear_lora_overlap; every other layer calls it", params=("self", "x", "bias")),
    Upstream(f"{_LORA}.layers.base:BaseLayerWithLoRA.set_mapping", "private", "vllm_ext.lora_dense_wrapper",
             "replaced on the class by route_merged_layers: registers each layer of an overlap-mode wrapper by its "
             "base layer's prefix", params=("self", "punica_wrapper")),
    Upstream(f"{_LORA}.layers.base_linear:BaseLinearLayerWithLoRA._apply_lora_to_output", "private",
             "vllm_ext.lora_dense_wrapper", "called by the routed merged layers and the overlap op's in-order path: "
             "the wrapper's add_lora_linear on the base output", params=("self", "x", "output")),
    Upstream(f"{_LORA}.layers.base_linear:BaseLinearLayerWithLoRA", "private", "vllm_ext.lora_dense_wrapper",
             "the overlap op reads each layer's LoRA tensors, slices, wrapper and base quant method",
             attrs=("lora_a_stacked", "lora_b_stacked", "output_slices", "base_layer")),
    Upstream("vllm.platforms.interface:Platform.get_punica_wrapper", "private", "vllm_ext.lora_dense",
             "replaced on the CUDA platform's class by one that names QerlPunicaWrapper (vLLM's own unless an "
             "engine asks for dense); reads the engine's additional_config with get_current_vllm_config_or_none"),
    # benchmarks (vllm_ext.bench.kernels)
    Upstream(f"{_LORA}.ops.triton_ops:LoRAKernelMeta.prepare_tensors", "calls", "vllm_ext.bench.kernels",
             "LoRA kernel timing", params=("self", "token_lora_mapping")),
    Upstream(f"{_LORA}.ops.triton_ops:LoRAKernelMeta.meta_args", "calls", "vllm_ext.bench.kernels",
             "LoRA kernel timing", params=("self", "token_nums", "specialize_active_lora")),
    Upstream(f"{_LORA}.ops.triton_ops:lora_shrink", "calls", "vllm_ext.bench.kernels", "LoRA kernel timing"),
    Upstream(f"{_LORA}.ops.triton_ops:lora_expand", "calls", "vllm_ext.bench.kernels", "LoRA kernel timing"),
)

# ---------------------------------------------------------------------------------------------------------
# verl

_ASR = "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer"
_EXT = "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension"
_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_WORKER = "verl.workers.engine_workers:ActorRolloutRefWorker"
_ADAPTER = "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter"

_VERL: tuple[Upstream, ...] = (
    # wrapped at import (verl_ext.patches)
    Upstream("verl.utils.config:validate_config", "wraps", "verl_ext.config",
             "check the qerl keys and normalise the config in the driver, before Ray starts anything",
             params=("config", "use_reference_policy", "use_critic"), wrapper="verl_ext.config:wrap_validate_config"),
    Upstream(f"{_ASR}._apply_quantization", "wraps", "verl_ext.rollout",
             "accept quantization=nvfp4 (verl 0.9.1 raises on it) and route vLLM to qerl's 'nvfp4' method",
             params=("self",), wrapper="verl_ext.rollout:wrap_apply_quantization"),
    Upstream(f"{_ASR}._preprocess_engine_kwargs", "wraps", "verl_ext.rollout",
             "put the run's engine options (additional_config: qerl_aqn) into vLLM's engine arguments",
             params=("self", "engine_kwargs"), wrapper="verl_ext.rollout:wrap_preprocess_engine_kwargs"),
    Upstream(f"{_ASR}._get_worker_extension_cls", "wraps", "verl_ext.rollout",
             "start vLLM workers with verl_ext.worker_extension.QerlVerlWorkerExtension (verl's extension + qerl's "
             "noise and adapter RPCs) when qerl is on", params=("self",),
             wrapper="verl_ext.rollout:wrap_get_worker_extension_cls"),
    Upstream(f"{_FSDP}:collect_lora_params", "wraps", "verl_ext.adapter_sync",
             "extract the LoRA adapter by parameter name: PEFT 0.21 matches FSDP1's wrapped module names against "
             "clean state-dict keys and returns nothing, which vLLM's add_lora then fails on (StopIteration)",
             params=("module", "layered_summon", "base_sync_done"), wrapper="verl_ext.adapter_sync:wrap_collect_lora_params"),
    Upstream("verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__", "wraps", "verl_ext.replay",
             "poll for finished rollouts every 0.1 s instead of 2 s (timing_s/gen came in multiples of 2 s)",
             params=("self", "trainer_mode", "trainer_config", "max_off_policy_threshold", "max_off_policy_strategy",
                     "sampler_kwargs", "poll_interval"), wrapper="verl_ext.replay:wrap_replay_buffer_init"),
    Upstream(f"{_ASR}.__init__", "wraps", "verl_ext.weight_socket",
             "export VERL_RAY_JOB_ID with a tag of the Ray session: the vLLM workers' weight-transfer socket is then "
             "unique per Ray cluster (every local cluster's first job is 01000000; runs side by side shared it)",
             params=("self", "config", "model_config", "rollout_mode", "workers", "replica_rank"),
             wrapper="verl_ext.weight_socket:wrap_server_init"),
    Upstream(f"{_ADAPTER}.__init__", "wraps", "verl_ext.weight_socket",
             "the sender's weight-transfer socket name with the same Ray-session tag as the receiver's",
             params=("self", "config", "model_config", "device_mesh", "replica_rank"),
             wrapper="verl_ext.weight_socket:wrap_server_adapter_init"),
    Upstream("verl.utils.torch_functional:logprobs_from_logits_v2", "wraps", "verl_ext.logprobs",
             "per-token log-probabilities in blocks of rows instead of verl's loop over rows (its path without "
             "flash-attn: one logsumexp per token under remove-padding)", params=("logits", "labels"),
             wrapper="verl_ext.logprobs:wrap_logprobs_from_logits_v2"),
    Upstream("verl.utils.fsdp_utils:collect_lora_params", "wraps", "verl_ext.adapter_sync",
             "the same fix for callers that import it from verl.utils.fsdp_utils",
             params=("module", "layered_summon", "base_sync_done"), wrapper="verl_ext.adapter_sync:wrap_collect_lora_params"),
    Upstream(f"{_FSDP}:FSDPEngine._build_module", "wraps", "verl_ext.actor",
             "for an NVFP4 checkpoint: build the HF model without compressed-tensors and load the packed bytes "
             "into NVFP4Linear layers", params=("self",), wrapper="verl_ext.actor:wrap_build_module"),
    Upstream(f"{_FSDP}:FSDPEngine._build_lora_module", "wraps", "verl_ext.actor",
             "for a BF16 checkpoint: quantize the decoder projections to NVFP4Linear before PEFT wraps them",
             params=("self", "module"), wrapper="verl_ext.actor:wrap_build_lora_module"),
    Upstream(f"{_WORKER}.init_model", "wraps", "verl_ext.actor",
             "parse this worker's qerl settings once, before the actor is built", params=("self",),
             wrapper="verl_ext.actor:wrap_init_model"),
    Upstream(f"{_WORKER}.update_weights", "wraps", "verl_ext.aqn_hook",
             "after each adapter sync, set the rollout engine's AQN noise for the next step (qerl_set_noise RPC)",
             params=("self", "global_steps", "mode"), wrapper="verl_ext.aqn_hook:wrap_update_weights"),
    Upstream("verl.utils.tracking:Tracking.__init__", "wraps", "verl_ext.aqn_hook",
             "remember the run's AQN schedule in the driver's logger",
             params=("self", "project_name", "experiment_name", "default_backend", "config"),
             wrapper="verl_ext.aqn_hook:wrap_tracking_init"),
    Upstream("verl.utils.tracking:Tracking.log", "wraps", "verl_ext.aqn_hook",
             "add qerl/aqn_sigma and qerl/aqn_stage of each step to verl's metrics", params=("self", "data", "step"),
             wrapper="verl_ext.aqn_hook:wrap_tracking_log"),
    # replaced for one call
    Upstream("verl.utils.qat:apply_qat_patches", "swaps", "verl_ext.worker_extension",
             "verl's extension would apply its NVFP4 QAT vLLM patches (2 of 3 targets gone in vLLM 0.24) to "
             "qerl's engine", wrapper="verl_ext.worker_extension:_without_verl_qat_patches"),
    # the worker extension (verl_ext.worker_extension)
    Upstream(_EXT, "subclasses", "verl_ext.worker_extension", "QerlVerlWorkerExtension",
             attrs=("_is_qat_model", "_is_modelopt_qat")),
    Upstream(f"{_EXT}.__new__", "overrides", "verl_ext.worker_extension",
             "no QAT detection for qerl's nvfp4 engine", params=("cls", "kwargs")),
    Upstream(f"{_EXT}.update_weights_from_ipc", "overrides", "verl_ext.worker_extension",
             "refuse base-weight syncs under nvfp4", params=("self", "peft_config", "base_sync_done", "use_shm")),
    Upstream(f"{_EXT}._update_weights", "overrides", "verl_ext.worker_extension",
             "adapter syncs: check the names, load through qerl's in-memory path",
             params=("self", "weights", "peft_config", "base_sync_done")),
    Upstream("verl.workers.rollout.vllm_rollout.utils:VLLM_LORA_INT_ID", "calls", "verl_ext.worker_extension",
             "the adapter id verl's generate uses"),
    Upstream("verl.workers.rollout.vllm_rollout.utils:VLLM_LORA_NAME", "calls", "verl_ext.worker_extension",
             "the adapter name verl's generate uses"),
    # the server and the rollout adapter
    Upstream(_ASR, "calls", "verl_ext.rollout", "the rollout config of each vLLM server", attrs=("config", "model_config")),
    Upstream(f"{_ASR}.clear_kv_cache", "calls", "verl_ext.aqn_hook", "KV computed under other noise is not reused",
             params=("self",)),
    Upstream(f"{_ADAPTER}._execute_method", "private", "verl_ext.aqn_hook", "the qerl_set_noise RPC on the server",
             params=("self", "method", "non_block", "timeout", "args", "kwargs")),
    Upstream(f"{_ADAPTER}._ensure_server_handle", "private", "verl_ext.aqn_hook", "the server handle, if this rank has one",
             params=("self",)),
    Upstream(_ADAPTER, "calls", "verl_ext.aqn_hook", "one RPC per replica", attrs=("server_handle", "_has_server")),
    Upstream(_ADAPTER, "private", "verl_ext.weight_socket", "the sender's weight-transfer socket name, qualified after "
             "__init__", attrs=("zmq_handle",)),
    Upstream(f"{_EXT}._get_zmq_handle", "private", "verl_ext.weight_socket",
             "the receiver's socket name, built from the VERL_RAY_JOB_ID that qerl qualifies", params=("self",)),
    # the actor
    Upstream(_WORKER, "calls", "verl_ext.aqn_hook", "the worker the hooks run in", attrs=("config", "role", "rollout", "actor")),
    Upstream(f"{_FSDP}:FSDPEngine", "calls", "verl_ext.actor", "the engine the actor is built in",
             attrs=("model_config", "engine_config", "use_remove_padding", "ulysses_sequence_parallel_size", "module")),
    Upstream("verl.models.transformers.monkey_patch:apply_monkey_patch", "calls", "verl_ext.actor",
             "verl's post-build step for an NVFP4 checkpoint",
             keywords=("model", "use_remove_padding", "ulysses_sp_size", "use_fused_kernels", "fused_kernels_backend")),
    Upstream("verl.utils.model:get_hf_auto_model_class", "calls", "verl_ext.actor", "the HF class to build",
             params=("hf_config",)),
    Upstream("verl.utils.torch_dtypes:PrecisionType.to_dtype", "calls", "verl_ext.actor", "the training dtype",
             params=("precision",)),
    Upstream("verl.utils.fsdp_utils:fsdp_version", "calls", "verl_ext.adapter_sync", "FSDP1 needs summon_full_params",
             params=("model",)),
    Upstream("verl.utils.device:get_torch_device", "calls", "verl_ext.adapter_sync", "empty the cache after extraction"),
    # config
    Upstream("verl.base_config:BaseConfig", "subclasses", "verl_ext.config", "QerlSettings"),
    Upstream("verl.workers.config:RolloutConfig", "calls", "verl_ext.config",
             "rollout.quantization and rollout.custom carry qerl's keys",
             keywords=("quantization", "custom", "engine_kwargs", "qat", "load_format")),
    Upstream("verl.workers.config:HFModelConfig", "calls", "verl_ext.config", "qerl train --check converts the model config",
             keywords=("path", "local_path", "lora_rank", "lora")),
    Upstream("verl.utils.config:omega_conf_to_dataclass", "calls", "verl_ext.config", "qerl train --check",
             params=("config", "dataclass_type")),
    Upstream("verl.trainer.ppo.utils:need_critic", "calls", "verl_ext.config", "qerl train --check", params=("config",)),
    Upstream("verl.trainer.ppo.utils:need_reference_policy", "calls", "verl_ext.config", "qerl train --check",
             params=("config",)),
    Upstream("verl.utils.reward_score:default_compute_score", "calls", "verl_ext.reward",
             "data sources that are not math", params=("data_source", "solution_str", "ground_truth", "extra_info")),
)

SURFACE: tuple[Upstream, ...] = _VLLM + _VERL


def wrapped() -> tuple[Upstream, ...]:
    """The entries :mod:`verl_ext.patches` applies at import (kind ``wraps``)."""
    return tuple(e for e in SURFACE if e.kind == "wraps")
