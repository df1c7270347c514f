"""Model sources for the torch frontend: an nn.Module, a saved `.pt2`, or a local
Hugging Face checkpoint directory (`config.json` + `*.safetensors`).

For a checkpoint directory the module is built with its parameters on no real
memory (uninitialised storage, never touched), exported, and each weight becomes
a `SafetensorsSource` that reads its tensor only when the backend writes it. A GPTQ
or AWQ checkpoint is built as its float model, and each quantized linear's weight
becomes a `QuantizedWeight` over its packed tensors (compiler/quant_import.py).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from npuc.compiler.pt2_safety import load_pt2
from npuc.compiler.quant_import import read_hf_quantization
from npuc.compiler.shapes import DeclaredInput
from npuc.compiler.weights import safetensors_layout
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import ConstSource, TensorSource, TensorType

_INT_INPUTS = {"input_ids", "attention_mask", "position_ids", "token_type_ids", "cache_position"}


def _damaged(msg: str) -> NpucError:
    return NpucError("NPUC-E0305", msg, "the checkpoint does not match its config.json: re-save it with "
                     "save_pretrained", exit_code=EXIT_IO)


class SafetensorsSource:
    """One tensor of a safetensors file, read on demand and cast to the model's dtype."""

    # Said outright: lowering would otherwise read and hash every weight to tell whether
    # prefill and decode share it (the file and key say so).
    in_memory = False

    def __init__(self, path: str, key: str, dtype: torch.dtype,
                 layout: tuple[str, tuple[int, ...], int, int] | None = None) -> None:
        self.path, self.key, self.dtype, self.layout = path, key, dtype, layout

    def file_range(self, want: TensorType) -> tuple[str, int, int] | None:
        """(path, offset, length) of the stored bytes, when they already are what the .om wants."""
        if self.layout is None:
            return None
        dtype, shape, offset, length = self.layout
        if dtype != want.dtype.value or shape != want.shape or length != want.nbytes:
            return None
        return self.path, offset, length

    def load(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(self.key).to(self.dtype)

    def describe(self) -> str:
        return f"{os.path.basename(self.path)}:{self.key}"


class StackedExpertsSource:
    """A fused experts parameter (transformers' `experts.gate_up_proj` [E, 2I, H] or
    `experts.down_proj` [E, H, I]) from a checkpoint that stores one tensor per expert:
    each part stacked over the experts, the parts concatenated along dim 1."""

    in_memory = False

    def __init__(self, parts: list[list[SafetensorsSource]], shape: tuple[int, ...]) -> None:
        self.parts, self.shape = parts, shape

    def load(self) -> torch.Tensor:
        try:
            t = torch.cat([torch.stack([s.load() for s in experts]) for experts in self.parts], dim=1)
        except RuntimeError as e:  # experts stored at different shapes
            raise _damaged(f"{self.describe()} do not stack: {str(e).splitlines()[0]}"[:300]) from None
        if tuple(t.shape) != self.shape:
            raise _damaged(f"{self.describe()} stack to {list(t.shape)}; config.json makes it {list(self.shape)}")
        return t

    def describe(self) -> str:
        first = self.parts[0][0]
        return f"{len(self.parts[0])} experts from {os.path.basename(first.path)}:{first.key}..."


# transformers' fused experts parameters, and the per-expert checkpoint tensors they stack.
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _experts_source(name: str, shape: tuple[int, ...], dtype: torch.dtype, index: dict[str, Any],
                    stored: Callable[[str], str | None] = lambda k: k,
                    expert_parts: Mapping[str, tuple[str, ...]] = _EXPERT_PARTS) -> StackedExpertsSource | None:
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("experts") or leaf not in expert_parts or len(shape) != 3:
        return None
    parts = []
    for part in expert_parts[leaf]:
        keys = [stored(f"{prefix}.{e}.{part}.weight") for e in range(shape[0])]
        if not all(k is not None and k in index for k in keys):
            return None
        parts.append([SafetensorsSource(index[k][0], k, dtype, index[k][1]) for k in keys if k is not None])
    return StackedExpertsSource(parts, shape)


class ConvertedSource:
    """A parameter that from_pretrained builds from stored tensors through one of transformers'
    WeightConverters (experts stacked and concatenated, q/k/v convs joined, a vocabulary
    unpadded...): the same converter runs on the stored tensors when the weight is read."""

    in_memory = False

    def __init__(self, converter: Any, first: str, target: str, parts: list[tuple[str, SafetensorsSource]],
                 module: nn.Module, shape: tuple[int, ...]) -> None:
        self.converter, self.first, self.target, self.parts, self.module = converter, first, target, parts, module
        self.shape = shape

    def load(self) -> torch.Tensor:
        conv = copy.deepcopy(self.converter)
        for pattern, src in self.parts:
            conv.add_tensor(self.first, src.key, pattern, src.load)  # a callable: read when converted
        try:
            out = conv.convert(self.first, model=self.module, config=getattr(self.module, "config", None))
            t = out[self.target]
            t = t[0] if isinstance(t, list) else t
        except Exception as e:  # noqa: BLE001 - transformers' converter on tensors of the wrong shapes
            raise _damaged(f"{self.describe()} cannot be converted: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}"[:300]) from None
        if tuple(t.shape) != self.shape:
            raise _damaged(f"{self.describe()} converts to {list(t.shape)}; config.json makes it {list(self.shape)}")
        return t.to(self.parts[0][1].dtype).contiguous()

    def describe(self) -> str:
        # Names the target: one stored tensor split into several (q, k, v) is several weights.
        first = self.parts[0][1]
        return f"{self.target} converted from {len(self.parts)} tensor(s): {first.describe()}..."


def _checkpoint_conversions(transformers: Any, module: nn.Module, index: Mapping[str, Any]
                            ) -> tuple[dict[str, str], dict[str, tuple[Any, str, list[tuple[str, str]]]]] | None:
    """How from_pretrained maps this checkpoint's names onto the module (5.x), by transformers'
    own renaming code and the model's conversion mapping, without reading a tensor:
    (module name -> stored name for each renamed key, module name -> (converter, its first
    target, [(source pattern, stored name)]) for each converted parameter). None where this
    transformers has no such machinery (4.x: stored names are module names)."""
    try:
        cml = importlib.import_module(f"{transformers.__name__}.core_model_loading")
        get = importlib.import_module(f"{transformers.__name__}.conversion_mapping").get_model_conversion_mapping
        rename, natural = cml.rename_source_key, cml.dot_natural_key
        transforms = list(get(module))
    except Exception:  # noqa: BLE001 - a version without (or with another form of) the machinery
        return None
    renamings = [t for t in transforms if isinstance(t, cml.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, cml.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = module.state_dict()
    prefix = getattr(module, "base_model_prefix", None)
    alias: dict[str, str] = {}
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for key in sorted(index, key=natural):  # transformers' order: experts stack in this order
        try:
            name, pattern = rename(key, renamings, converters, prefix, meta)
        except Exception:  # noqa: BLE001 - a pattern this version cannot apply: the key stays as stored
            name, pattern = key, None
        if name not in meta and key in meta:
            name, pattern = key, None
        if name not in meta:
            continue
        if pattern is None:
            alias.setdefault(name, key)
        elif pattern in by_pattern:
            groups.setdefault(name, (by_pattern[pattern], []))[1].append((pattern, key))
    converted: dict[str, tuple[Any, str, list[tuple[str, str]]]] = {}
    for first, (conv, keys) in groups.items():
        targets = list(getattr(conv, "target_patterns", []))
        for t in targets or [first]:  # a one-to-many converter (a split) names its other targets
            converted[first.replace(targets[0], t) if targets else first] = (conv, first, keys)
    return alias, converted


@dataclass
class LoadedModel:
    module: nn.Module
    kind: str  # "module" | "pt2" | "hf"
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, ConstSource] = field(default_factory=dict)
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    program: torch.export.ExportedProgram | None = None  # a loaded .pt2

    def resolve(self, fqn: str, tensor: torch.Tensor | None) -> ConstSource:
        if fqn in self.sources:
            return self.sources[fqn]
        if tensor is None:
            raise NpucError("NPUC-E0305", f"no data for weight {fqn!r}", "the checkpoint is incomplete",
                            exit_code=EXIT_IO)
        return TensorSource(tensor.detach(), "module")


def load_source(model: Any, *, trust_pickle: bool = False) -> LoadedModel:
    """`trust_pickle` loads a `.pt2` torch would unpickle (running its code); see pt2_safety."""
    if isinstance(model, nn.Module):
        return LoadedModel(model.eval(), "module")
    if isinstance(model, torch.export.ExportedProgram):
        return LoadedModel(model.module(), "pt2", input_dtypes=_ep_input_dtypes(model), program=model)
    path = Path(os.fspath(model))
    if not path.exists():
        raise NpucError("NPUC-E0401", f"model path {str(path)!r} does not exist",
                        "pass a .pt2 file, a Hugging Face checkpoint folder or an .onnx file", exit_code=EXIT_IO)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NpucError("NPUC-E0103", f"{str(path)!r} is a folder without config.json",
                            "a Hugging Face checkpoint folder holds config.json and *.safetensors",
                            exit_code=EXIT_USAGE)
        return load_hf_dir(path)
    if path.suffix == ".json":  # a config alone: a plan's shapes and bytes, no weights (npuc plan)
        return load_hf_dir(path.parent, config_file=path)
    if path.suffix.lower() == ".gguf":  # llama.cpp's format (compiler/gguf_import.py)
        from npuc.compiler.gguf_import import load_gguf

        return load_gguf(path)
    if path.suffix == ".pt2":
        ep = load_pt2(str(path), trust_pickle=trust_pickle)
        loaded = LoadedModel(ep.module(), "pt2", input_dtypes=_ep_input_dtypes(ep), program=ep)
        loaded.files.append(str(path))
        return loaded
    raise NpucError("NPUC-E0103", f"cannot tell what kind of model {str(path)!r} is",
                    "npuc reads .onnx, .pt2 and .gguf files and Hugging Face checkpoint folders",
                    exit_code=EXIT_USAGE)


def program_inputs(ep: torch.export.ExportedProgram) -> dict[str, tuple[tuple[Any, ...], torch.dtype]]:
    """The tensor user inputs of an exported program, in order: name -> (shape, dtype)."""
    out = {}
    user = {s.arg.name for s in ep.graph_signature.input_specs
            if s.kind.name == "USER_INPUT" and hasattr(s.arg, "name")}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in user and isinstance(n.meta.get("val"), torch.Tensor):
            out[n.name] = (tuple(n.meta["val"].shape), n.meta["val"].dtype)
    return out


def _ep_input_dtypes(ep: torch.export.ExportedProgram) -> dict[str, torch.dtype]:
    return {name: dt for name, (_, dt) in program_inputs(ep).items()}


@contextlib.contextmanager
def _parameters_without_memory() -> Iterator[None]:
    """Create every nn.Parameter on the meta device while a module is built
    (buffers such as RoPE's inv_freq stay real: they are computed, not loaded)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _safetensors_index(path: Path) -> dict[str, tuple[str, tuple[str, tuple[int, ...], int, int] | None]]:
    """key -> (file, byte layout), from the files' headers alone."""
    index: dict[str, tuple[str, tuple[str, tuple[int, ...], int, int] | None]] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            layout = safetensors_layout(str(f))
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise NpucError("NPUC-E0407", f"cannot read the safetensors header of {str(f)!r}: {e}",
                            "the checkpoint file is damaged", exit_code=EXIT_IO) from None
        for k, lay in layout.items():
            index[k] = (str(f), lay)
    return index


def _has_experts_choice(transformers: Any) -> bool:
    """Whether this transformers builds models with a choice of MoE experts implementation
    (the `experts_implementation` keyword, 5.x): feature-detected, never by version."""
    return hasattr(transformers.PreTrainedModel, "get_correct_experts_implementation")


class AbsentSource:
    """A weight of a config-only model (`npuc plan config.json`): its shape and dtype are
    known, its bytes are not, and nothing may ask for them."""

    in_memory = False

    def __init__(self, name: str) -> None:
        self.name = name

    def load(self) -> torch.Tensor:
        raise NpucError("NPUC-E0305", f"{self.name!r} has no data: the model is a config alone",
                        "a config.json is for `npuc plan`; compile a checkpoint folder", exit_code=EXIT_USAGE)

    def describe(self) -> str:
        return f"{self.name} (config only)"


def parameter_owners(module: nn.Module) -> tuple[dict[int, list[str]], dict[int, nn.Parameter]]:
    """Each parameter object (by id) with every name it goes by (tied weights: several), and the object."""
    owners: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return owners, params


def missing_weights(missing: list[str], where: str, hint: str) -> NpucError:
    return NpucError("NPUC-E0305", f"{len(missing)} weight(s) are not in {where}: " + ", ".join(missing[:5])
                     + ("..." if len(missing) > 5 else ""), hint, exit_code=EXIT_IO)


def give_storage(module: nn.Module, params: Mapping[int, nn.Parameter]) -> None:
    """Replace the meta parameters of a module built by `_parameters_without_memory` with
    uninitialised real ones (export needs storage; its pages are never touched), ties kept."""
    fresh: dict[int, nn.Parameter] = {
        pid: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False) for pid, p in params.items()}
    for mod in module.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = fresh[id(p)]


def load_hf_dir(path: Path, config_file: Path | None = None, layers: int | None = None) -> LoadedModel:
    """A checkpoint folder, or with `config_file` that config alone (every weight an
    AbsentSource: shapes and bytes for a plan, nothing to write). `layers`: build that many
    decoder layers instead of the config's (compiler/mtp.py: the layer after the last is the
    checkpoint's multi-token-prediction layer, stored as `model.layers.<num_hidden_layers>`)."""
    try:
        import transformers
    except ImportError:
        raise NpucError("NPUC-E0104", "reading a Hugging Face checkpoint needs transformers",
                        "pip install 'npuc[hf]'", exit_code=EXIT_USAGE) from None
    where = config_file if config_file is not None else path / "config.json"
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_file or path), local_files_only=True)
    except Exception as e:
        raise NpucError("NPUC-E0407", f"cannot read {str(where)!r}: {e}",
                        "the folder should come from save_pretrained", exit_code=EXIT_IO) from None
    if layers is not None:
        _set_layers(config, layers)
    # A quantized checkpoint (GPTQ, AWQ) is built as its float model, whose linears' weights
    # are then found as packed tensors (compiler/quant_import.py): transformers could only
    # build its quantized layers with optimum or gptqmodel, and npuc needs none of them.
    quant = read_hf_quantization(config)
    if quant is not None:
        with contextlib.suppress(AttributeError):
            del config.quantization_config
    archs = getattr(config, "architectures", None) or []
    # A language-model head by either naming (XForCausalLM, GPT-2's GPT2LMHeadModel); a bare
    # XModel folder builds the base model, whose output is the last hidden state.
    auto = transformers.AutoModelForCausalLM \
        if any("CausalLM" in a or a.endswith("LMHeadModel") for a in archs) or not archs else transformers.AutoModel
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    index = _safetensors_index(path) if config_file is None else {}
    if not index and config_file is None:
        raise NpucError("NPUC-E0305", f"{str(path)!r} has no *.safetensors weights",
                        "save the model with save_pretrained(..., safe_serialization=True)", exit_code=EXIT_IO)
    build: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    # Mixture-of-experts layers: transformers' batched_mm experts (5.x) gather each token's
    # expert weights with static shapes, where its default loops over the experts hit.
    # Older versions have no such choice and reject the keyword: asked only where it exists.
    if _has_experts_choice(transformers):
        build["experts_implementation"] = "batched_mm"
    try:
        with _parameters_without_memory():
            try:
                module = auto.from_config(config, **build)
            except ValueError as e:
                # A family whose attention transformers runs in eager only (logit soft-capping,
                # sinks) says so: built eager, as from_pretrained would be.
                if "attention implementation" not in str(e) and "sdpa" not in str(e).lower():
                    raise
                module = auto.from_config(config, **(build | {"attn_implementation": "eager"}))
    except ValueError as e:
        raise NpucError("NPUC-E0306", f"transformers cannot build {archs or config.model_type}: {e}",
                        "check that your transformers version supports this architecture",
                        exit_code=EXIT_UNSUPPORTED) from None
    module.eval()
    if "experts_implementation" not in build:
        moe = next((type(m).__name__ for m in module.modules() if "moe" in type(m).__name__.lower()), None)
        if moe is not None:
            raise NpucError("NPUC-E0306", f"transformers {transformers.__version__} builds {moe} as a loop over "
                            "its experts, which depends on the routing (no static shapes to trace)",
                            "use transformers 5 or newer, whose batched experts npuc traces",
                            exit_code=EXIT_UNSUPPORTED)
    # Give each parameter uninitialised storage (pages are never touched) and find
    # its tensor in the checkpoint; tied parameters share one object, so one key.
    owners, params = parameter_owners(module)
    sources: dict[str, ConstSource] = {}
    missing = []
    mapping = _checkpoint_conversions(transformers, module, index) if index else None
    alias, converted = mapping if mapping is not None else ({}, {})

    def stored(name: str) -> str | None:
        """The checkpoint's name for module tensor `name`: the one from_pretrained would load it
        from (its own, or the key transformers renames to it)."""
        if name in alias:
            return alias[name]
        return name if name in index and name not in converted else None

    def source(name: str, p: nn.Parameter) -> ConstSource | None:
        key = stored(name)
        if key is not None:
            file, layout = index[key]
            if layout is not None and layout[1] != tuple(p.shape):  # from_pretrained refuses it too
                raise _damaged(f"{os.path.basename(file)}:{key} is stored as {list(layout[1])}; config.json makes "
                               f"{name} {list(p.shape)}")
            return SafetensorsSource(file, key, p.dtype, layout)
        if name in converted:
            conv, first, keys = converted[name]
            return ConvertedSource(conv, first, name, [(pat, SafetensorsSource(index[k][0], k, p.dtype, index[k][1]))
                                                       for pat, k in keys], module, tuple(p.shape))
        return None

    for pid, names in owners.items():
        p = params[pid]
        if config_file is not None:
            for n in names:
                sources[n] = AbsentSource(names[0])
            continue
        src = next((s for s in (source(n, p) for n in names) if s is not None), None)
        if src is None:
            src = _experts_source(names[0], tuple(p.shape), p.dtype, index, stored)
            if src is None and quant is not None:
                src = quant.weight(names[0], tuple(p.shape), p.dtype, index)
        if src is None:
            missing.append(names[0])
            continue
        for n in names:
            sources[n] = src
    if missing:
        raise missing_weights(missing, "the checkpoint", "the checkpoint does not match its config.json")
    give_storage(module, params)
    files = [str(where)] + sorted({f for f, _ in index.values()})
    dtypes = {n: torch.int64 for n in _INT_INPUTS}
    return LoadedModel(module, "hf", {"use_cache": False}, sources, dtypes, files)


def _set_layers(config: Any, layers: int) -> None:
    """num_hidden_layers = layers, a per-layer list of the config (layer types) extended by
    repeating its last entry."""
    old = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == old and old > 0 and key.endswith("layer_types"):
            setattr(config, key, [*value, *[value[-1]] * (layers - old)])
    config.num_hidden_layers = layers


def declared_inputs(loaded: LoadedModel) -> dict[str, DeclaredInput]:
    """The model's tensor inputs as it declares them (for --input_shape checking)."""
    import inspect

    from npuc.ir import DType

    def dt(t: Any) -> str:
        try:
            return str(DType.from_torch(t))
        except KeyError:
            return str(t)

    if loaded.program is not None:
        return {name: DeclaredInput(dt(d), tuple(x if isinstance(x, int) else str(x) for x in shape))
                for name, (shape, d) in program_inputs(loaded.program).items()}
    try:
        params = inspect.signature(loaded.module.forward).parameters
    except (TypeError, ValueError):
        return {}
    out = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in loaded.fixed_kwargs:
            continue
        if loaded.kind == "hf" and name not in _INT_INPUTS:
            continue
        dtype = dt(loaded.input_dtypes[name]) if name in loaded.input_dtypes else "tensor"
        required = p.default is inspect.Parameter.empty or (loaded.kind == "hf" and name == "input_ids")
        out[name] = DeclaredInput(dtype, None, required)
    return out
