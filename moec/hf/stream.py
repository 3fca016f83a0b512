"""An HF model directory read one decoder layer at a time through transformers' own modeling code: the model
built with its parameters on the meta device (buffers such as RoPE's inv_freq computed as usual), and the
tensors of one decoder layer (or of the global modules: embeddings, final norm, LM head) materialised from the
safetensors shards when asked for, through transformers' checkpoint -> in-memory conversions
(`transformers.conversion_mapping.get_model_conversion_mapping` + `core_model_loading`: mixtral's per-expert
w1/w2/w3 fused into `gate_up_proj`, renamed prefixes, ...), so no per-architecture table lives here.

    src = SourceModel(path, dtype=torch.float32)
    src.load_globals()              # embeddings, final norm, LM head: real tensors
    layer = src.load_layer(3)       # model.model.layers[3] with real weights
    ...
    src.release(layer)              # its parameters back on the meta device

Memory: one layer's parameters (plus the global ones) at a time; a safetensors shard is memory-mapped, only the
tensors asked for are read.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import UserError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device and keep their buffers where they are
    computed (non-persistent buffers such as RoPE's inv_freq are computed in __init__ and never loaded)."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def trim_heap() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; nothing elsewhere). A layer's tensors of a few
    MB each are served from the heap once glibc has raised its mmap threshold, and without a trim the freed
    layer stays resident, so the next layer's peak would sit on top of it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise UserError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return json.loads(f.read_text())


def source_dtype(cfg: dict, shard: Path | None) -> torch.dtype:
    """The checkpoint's dtype: config.json's `dtype` (or `torch_dtype`), else its first floating tensor's."""
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name:
        return getattr(torch, str(name).removeprefix("torch."), torch.float32)
    codes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if shard is not None and shard.is_file():
        with safe_open(shard, "pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if (code := h.get_slice(k).get_dtype()) in codes:
                    return codes[code]
    return torch.float32


def build_meta(config, dtype: torch.dtype):
    """The transformers causal LM of `config` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        from ..runtime.hf_layout import SUPPORTED

        raise UserError(f"unsupported architecture {model.config.model_type!r}: moec's engine implements "
                        f"{', '.join(SUPPORTED)}, and the transformers path finds no decoder layers at "
                        f"model.model.layers of {type(model).__name__}")
    return layers


class SourceModel:
    """An HF directory as a meta-initialised transformers model whose layers are materialised on demand."""

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu"):
        from transformers import AutoConfig

        self.path = Path(path)
        self.config_dict = read_config(self.path)
        try:
            self.config = AutoConfig.from_pretrained(self.path)
        except (ValueError, KeyError) as e:
            raise UserError(f"{self.path}: transformers cannot read its config.json ({str(e).splitlines()[0]})") \
                from None
        # tensors are read and converted (experts fused, ...) in the checkpoint's dtype, then cast one parameter at a
        # time to the compute dtype: the conversion's temporaries are the source's size, not fp32's
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({self.path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        self.source_dtype = source_dtype(self.config_dict, files[0] if files else None)
        self.dtype = dtype or self.source_dtype
        self.device = device
        self.model = build_meta(self.config, self.source_dtype)
        self.layers = decoder_layers(self.model)
        if not files:
            raise UserError(f"{self.path}: no *.safetensors weights (pickled .bin checkpoints are not read)")
        self.files = files
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.mapping = get_model_conversion_mapping(self.model)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        meta_sd = self.model.state_dict()
        self._where: dict[str, Path] = {}  # checkpoint key -> shard
        self._group: dict[str, list[str]] = {}  # "global" or layer index -> checkpoint keys
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    self._where[k] = f
                    target, _ = rename_source_key(k, renamings, converters, self.model.base_model_prefix, meta_sd)
                    m = _LAYER.match(target)
                    self._group.setdefault(m.group(1) if m else "global", []).append(k)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _load(self, keys: list[str]) -> None:
        """Materialise the model parameters the checkpoint keys `keys` map to (conversions applied)."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        handles = {f: safe_open(f, "pt") for f in {self._where[k] for k in keys}}
        sd = {k: handles[self._where[k]].get_slice(k) for k in keys}
        cfg = LoadStateDictConfig(device_map={"": self.device}, dtype=self.source_dtype, weight_mapping=self.mapping)
        from transformers.utils import logging as hf_logging

        old = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # no thread pool: one tensor at a time, bounded memory
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per layer would drown moec's own progress
        try:
            info, _ = convert_and_load_state_dict_in_model(self.model, sd, cfg)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
            if old is None:
                os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
            else:
                os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = old
        if info.conversion_errors:
            raise UserError(f"{self.path}: transformers could not convert {next(iter(info.conversion_errors))!r}")

    def _cast(self, module: nn.Module) -> None:
        """Every loaded floating parameter of `module` in the compute dtype, one at a time."""
        if self.dtype == self.source_dtype:
            return
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and not p.is_meta and p.is_floating_point() and p.dtype != self.dtype:
                    mod._parameters[name] = nn.Parameter(p.detach().to(self.dtype), requires_grad=False)
                    del p
            for name, b in list(mod._buffers.items()):
                if b is not None and b.is_floating_point() and b.dtype == self.source_dtype:
                    mod._buffers[name] = b.to(self.dtype)

    def load_globals(self) -> None:
        """Embeddings, final norm, LM head (every parameter outside the decoder layers); ties the LM head."""
        self._load(self._group.get("global", []))
        for name, mod in self.model.named_children():
            if name != "model":
                self._cast(mod)
        for mod in self.model.model.children():
            if mod is not self.layers:
                self._cast(mod)
        if getattr(self.model.config.get_text_config(), "tie_word_embeddings", False):
            self.model.tie_weights()
        missing = [n for n, p in self.model.named_parameters() if p.is_meta and not _LAYER.match(n)]
        if missing:
            raise UserError(f"{self.path}: no checkpoint tensor for {missing[0]!r}")

    def load_layer(self, i: int) -> nn.Module:
        """Decoder layer i with its weights from the shards (in self.dtype, on self.device)."""
        self._load(self._group.get(str(i), []))
        layer = self.layers[i]
        self._cast(layer)
        missing = [n for n, p in layer.named_parameters() if p.is_meta]
        if missing:
            raise UserError(f"{self.path}: no checkpoint tensor for 'model.layers.{i}.{missing[0]}'")
        return layer

    def release(self, module: nn.Module) -> None:
        """Every parameter of `module` back on the meta device (its memory freed, and handed back to the system:
        trim_heap)."""
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and not p.is_meta:
                    mod._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)
        trim_heap()

    def fingerprint(self) -> dict:
        """sha256 of config.json and of the weight files (the engine's HFCheckpoint computes the same)."""
        from ..runtime.hf_layout import fingerprint

        return fingerprint(self.path, self.files)
