"""A Llama-family causal LM's forward over static key/value buffers, and its compiled form.

Eager decoding runs transformers' forward over a ``DynamicCache``: dozens of small operators a layer, each
dispatched from Python, which on a CPU cost as much as the matrix products of a one-token forward. Here the
model's own modules and weights (projections, norms, activation, rotary embedding) run in one function over
preallocated buffers ``[rows, kv_heads, capacity, head_dim]`` written at the slots a forward fills
(gpt-fast's layout), and ``torch.compile`` fuses everything between the products, with the weights frozen
so inductor prepacks them for its own CPU kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.nn import functional as F

from mtad.models import shortlist_draft
from mtad.models.devices import cpu_flags, onednn_runs
from mtad.models.errors import PairError

ENGINES = ("eager", "compiled")
FEW_QUERIES = 16
"""Up to this many queries a row, attention is two products and a softmax; beyond, the fused kernel."""


def resolve_engine(engine: str | None) -> str:
    """An explicit engine wins, then the operator's ``MTAD_ENGINE``, else ``auto`` (:func:`choose_engine`
    decides once the models are loaded)."""
    if engine in (None, "auto"):
        engine = os.environ.get("MTAD_ENGINE") or "auto"
    if engine not in ("auto", *ENGINES):
        raise PairError(f"engine must be auto or one of {', '.join(ENGINES)}; got {engine!r}")
    return engine


def choose_engine(engine: str, device: torch.device, draft: torch.nn.Module, target: torch.nn.Module) -> str:
    """What ``auto`` means for a loaded pair: ``compiled`` wherever the engine can run the target
    (:func:`supports`) and the draft reads none of the target's features, else ``eager``. In the bench every
    decoder ran faster compiled, on a CPU (bf16, and fp32 on AVX2) and on a GPU, where the compiled engine
    replays CUDA graphs. An explicit engine is returned as it is."""
    if engine != "auto":
        return engine
    # inductor's GPU kernels (Triton) need compute capability 7.0 or newer
    old_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0)
    if supports(target) is None and not getattr(draft, "reads_features", False) and not old_gpu:
        return "compiled"
    return "eager"


def supports(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on the compiled engine, or None when it can (a Llama-family decoder whose
    layers are transformers' Llama layers, as both shipped pairs' targets are, and the shortlist drafts
    whose layers are copies of them)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or head(model) is None:
        return f"{type(model).__name__} is not a Llama-family causal LM with an lm_head"
    attn = layers[0].self_attn
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return f"{type(attn).__name__} is not a Llama attention layer"
    cfg = model.config
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not supported by the compiled engine"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biased projections are not supported by the compiled engine"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"the {cfg.hidden_act} activation is not supported by the compiled engine (SiLU only)"
    if len({p.device for p in model.parameters()}) > 1:  # device_map="auto" over several devices
        return "it is split over several devices, and the compiled engine keeps its cache on one"
    return None


# The compiled graphs call the packed product as an opaque operator (the compiler cannot lower a packed weight
# that comes in as an input rather than a constant). It is declared with torch.library's low-level
# define/impl rather than ``custom_op``, whose Python wrapper adds its own cost to each of the many products
# of a forward.
torch.library.define("mtad::packed_linear", "(Tensor x, Tensor packed, int out_features) -> Tensor")


@torch.library.impl("mtad::packed_linear", "CompositeExplicitAutograd")
def _packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # any leading dims


@torch.library.register_fake("mtad::packed_linear")
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


packed_linear = torch.ops.mtad.packed_linear.default
"""``packed_linear(x, packed, out_features)``: ``x @ W.T`` with ``W`` prepacked for oneDNN
(``mtad.models.kernels``)."""


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` by PyTorch's int8-weight kernel (``aten._weight_int8pack_mm``), which
    reads half the bytes of a bf16 product: what an int8 draft's one-row forward multiplies with on either engine
    (:class:`mtad.models.shortlist_draft.Int8Linear`). Compiled, inductor calls the kernel straight from its
    wrapper (an operator of this library's around it added a Python call to most of a draft's products)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return shortlist_draft.int8_product(flat, qweight, scale).reshape(*x.shape[:-1], out_features)


LayerWeights = tuple[tuple[torch.Tensor, ...], str, tuple[int, ...]]
"""A decoder layer as :func:`decoder_layer` takes it: its tensors, the form of its products (``plain``,
``packed``, ``int8`` or ``gemv``: :func:`layer_weights`, :func:`int8_layer_weights`,
:func:`gemv_layer_weights`), and the output width of each of q, k, v, o, gate, up and down."""


def hold_widths(*parts: Any) -> None:
    """Mark every tensor in ``parts`` (nested tuples and lists) static in dynamo's eyes: its shape is a model's
    widths. Dynamo makes a dimension generic once a second call differs in it; the layer function is shared by
    every model in the process, so without this a second model (the page's other pair) compiled graphs generic
    in its widths, whose one-token forwards ran many times slower and took minutes to compile.
    Token and row counts may still turn generic, as within one model."""
    for part in parts:
        if isinstance(part, torch.Tensor):
            torch._dynamo.mark_static(part)
        elif isinstance(part, (tuple, list)):
            hold_widths(*part)


def head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What turns a model's final hidden states into its logits: a shortlist draft's logits over its
    shortlist (:mod:`mtad.models.shortlist_draft`), else the ``lm_head``; None when it has neither."""
    return getattr(model, "shortlist_logits", None) or getattr(model, "lm_head", None)


def layer_weights(layer: torch.nn.Module) -> LayerWeights:
    """A decoder layer's tensors as :func:`decoder_layer` takes them, the form of its products (``packed``
    when oneDNN-packed, else ``plain``), and their widths (read once here, not at every forward). Packed: the
    two norms, then q, k and v as one packed matrix, o, gate and up as one, and down (three fewer products a
    layer: faster at one row); made once per layer and weights, and the layers' own packed copies of the fused
    matrices are dropped (an eager forward packs them again when it needs them). Else the seven plain matrices.
    An int8 layer (a shortlist draft's) counts with its dequantised matrix, which is what its products
    multiply by from two rows on, and is packed when its model's kernel is oneDNN."""
    linears, norms = _parts(layer)
    mats = tuple(lin.dense(norms[0].dtype) if hasattr(lin, "dense") else lin.weight for lin in linears)
    widths = tuple(lin.out_features for lin in linears)
    onednn = all(callable(getattr(lin, "packed", None)) or getattr(lin, "kernel", None) == "onednn" for lin in linears)
    if not onednn or not onednn_runs(mats[0].dtype):
        return (*norms, *mats), "plain", widths
    stamp = tuple((m.data_ptr(), m.dtype) for m in mats)
    kept = layer.__dict__.get("_mtad_fused")
    if kept is None or kept[0] != stamp:
        q, k, v, o, gate, up, down = linears
        with torch.inference_mode():
            qkv = torch.cat(mats[:3]).detach()
            gate_up = torch.cat(mats[4:6]).detach()
            fused = tuple(torch.ops.mkldnn._reorder_linear_weight(w, None) for w in (qkv, gate_up))
            own = tuple(  # a oneDNN layer's own packed copy, shared with its eager forward
                lin.packed()
                if callable(getattr(lin, "packed", None))
                else torch.ops.mkldnn._reorder_linear_weight(m, None)
                for lin, m in ((o, mats[3]), (down, mats[6]))
            )
            packed = (fused[0], own[0], fused[1], own[1])
        for lin in (q, k, v, gate, up):
            if hasattr(lin, "_packed"):
                lin._packed = None
        kept = layer.__dict__["_mtad_fused"] = (stamp, packed)
    return (*norms, *kept[1]), "packed", widths


GEMV_INPUT_BYTES = 24 * 1024
"""The most bytes of input a product in the ``gemv`` form reduces against a matrix; a larger one takes the
packed product. The reduction rereads every token's input for every row of the matrix, so it beats oneDNN
only while those inputs stay in the core's first-level cache as the matrix streams past: SmolLM2's down
projection (1,536 fp32 inputs) is faster reduced at four tokens (24 KiB) and faster packed at five."""


def _reducible(x: torch.Tensor) -> bool:
    """Whether ``x`` [..., tokens, width] is small enough for the ``gemv`` form's reductions
    (:data:`GEMV_INPUT_BYTES`)."""
    return _fits(x.shape[-2], x.shape[-1], x.element_size())


def _fits(tokens: int, width: int, element_size: int) -> bool:
    """:func:`_reducible` from a shape, before the input exists."""
    return tokens * width * element_size <= GEMV_INPUT_BYTES


@functools.cache
def gemv_tokens(dtype: torch.dtype) -> int:
    """The most tokens of one row whose CPU forward in ``dtype`` takes the ``gemv`` form
    (:func:`gemv_layer_weights`), 0 for none, as SmolLM2-135M's forwards showed: fp32 one token everywhere
    (the reduction reads each weight once and beats oneDNN's packed product, with AVX-512 and AVX2 alike)
    and up to six where PyTorch dispatches to AVX2, whose few-row oneDNN products read the weights slowly
    (at eight tokens the reductions lose; with AVX-512 oneDNN is as fast from three); bf16 one token where
    the CPU has AVX512-BF16 but not AMX (from two tokens oneDNN's bf16 products are faster; AMX not tried,
    left to oneDNN)."""
    if dtype == torch.float32:
        return 6 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 1
    flags = cpu_flags()
    return int(dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags)


def gemv_layer_weights(layer: torch.nn.Module) -> LayerWeights | None:
    """A layer's tensors for a one-row CPU forward of up to :func:`gemv_tokens` tokens in the ``gemv``
    form: the two norms, the layer's own q, k, v, o, gate, up and down matrices (no copy), then, for a
    oneDNN layer, its four packed products (:func:`layer_weights`'s, shared) for inputs larger than
    :data:`GEMV_INPUT_BYTES`. Compiled, each other product is a reduction inductor generates
    (:func:`_gemv`), which streams the matrix once with no call into a library. None for dtypes with no
    such tokens, other devices, and int8 layers (inductor's int8-to-fp32 reduction is far slower than the
    fp32 one)."""
    linears, norms = _parts(layer)
    if not gemv_tokens(norms[0].dtype) or norms[0].device.type != "cpu":
        return None
    if any(hasattr(lin, "qweight") for lin in linears):
        return None
    packed, form, _ = layer_weights(layer)  # for inputs too large to reduce (GEMV_INPUT_BYTES), shared
    mats = (*(lin.weight for lin in linears), *(packed[2:] if form == "packed" else ()))
    return (*norms, *mats), "gemv", tuple(lin.out_features for lin in linears)


def int8_layer_weights(layer: torch.nn.Module) -> LayerWeights | None:
    """An int8 layer's tensors for a one-row CPU forward, in the ``int8`` form: the two norms, then q, k and v
    as one int8 matrix and its row scales (in the kernel's input dtype), o's, gate and up as one, and down's;
    None unless every product of the layer is an int8 one (a shortlist draft's) on a CPU whose int8 kernel
    takes the layer's dtype (:func:`~mtad.models.shortlist_draft.int8_kernel_input`), where the eager engine
    too multiplies one row with that kernel (and, right after a target forward has pushed the draft's weights
    out of the cache, reading fewer bytes is what counts)."""
    linears, norms = _parts(layer)
    kernel_input = shortlist_draft.int8_kernel_input(norms[0].dtype)
    if kernel_input is None or norms[0].device.type != "cpu":
        return None
    if not all(hasattr(lin, "qweight") for lin in linears):
        return None
    stamp = (kernel_input, *((lin.qweight.data_ptr(), lin.scale.data_ptr()) for lin in linears))
    kept = layer.__dict__.get("_mtad_int8")
    if kept is None or kept[0] != stamp:  # made once per layer and weights, not per generation
        with torch.inference_mode():
            tensors = []
            for group in (linears[:3], linears[3:4], linears[4:6], linears[6:]):
                # a concatenation is a fresh tensor from PyTorch's allocator, 64-byte aligned as the kernel needs
                tensors.append(torch.cat([lin.qweight for lin in group]))
                tensors.append(torch.cat([lin.scale for lin in group]).to(kernel_input))
        kept = layer.__dict__["_mtad_int8"] = (stamp, tuple(tensors))
    return (*norms, *kept[1]), "int8", tuple(lin.out_features for lin in linears)


def _parts(layer: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], tuple[torch.Tensor, torch.Tensor]]:
    """A Llama decoder layer's q, k, v, o, gate, up and down projections, and its two norms' weights."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return linears, (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)


def decoder_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    form: str,
    widths: tuple[int, ...],
    head_dim: int,
    scaling: float,
    eps: float,
) -> torch.Tensor:
    """One Llama decoder layer over ``h`` [rows, n, hidden] (transformers' ``LlamaDecoderLayer`` in one
    function): keys and values written at ``slots`` of the buffers, attention over the first
    ``mask.shape[-1]`` slots. ``weights`` and ``form``: :func:`layer_weights`, :func:`int8_layer_weights`
    or :func:`gemv_layer_weights`; ``widths``: the output width of each of q, k, v, o, gate, up and down."""
    q_n, k_n, v_n, o_n, g_n, u_n, d_n = widths
    rows, n, _ = h.shape
    mats = weights[2:]
    packed = mats[7:] if form == "gemv" else mats  # the gemv form's packed products, where it has them

    def fused(x: torch.Tensor) -> bool:
        """Whether x's products are the fused ones (q, k and v in one product, gate and up in one): always
        in the packed and int8 forms, in the gemv form for an input too large to reduce."""
        if form == "gemv":
            return bool(packed) and not _reducible(x)
        return form in ("packed", "int8")

    def product(x: torch.Tensor, i: int, width: int) -> torch.Tensor:
        """The i-th product of the fused forms: q, k and v; o; gate and up; down (see layer_weights)."""
        if form == "int8":
            return int8_linear(x, mats[2 * i], mats[2 * i + 1], width)
        return packed_linear(x, packed[i], width)

    def separate(x: torch.Tensor, j: int) -> torch.Tensor:
        """The j-th of q, k, v, o, gate, up and down in the plain and gemv forms."""
        return F.linear(x, mats[j]) if form == "plain" else _gemv(x, mats[j])

    x = _rms_norm(h, weights[0], eps)
    if fused(x):
        q, k, v = product(x, 0, q_n + k_n + v_n).split([q_n, k_n, v_n], dim=-1)
    else:
        q, k, v = separate(x, 0), separate(x, 1), separate(x, 2)
    q = q.reshape(rows, n, -1, head_dim).transpose(1, 2)
    k = k.reshape(rows, n, -1, head_dim).transpose(1, 2)
    v = v.reshape(rows, n, -1, head_dim).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k_buf.index_copy_(2, slots, k)
    v_buf.index_copy_(2, slots, v)
    o = _attention(q, k_buf, v_buf, mask, scaling).transpose(1, 2).reshape(rows, n, -1)
    h = h + (product(o, 1, o_n) if fused(o) else separate(o, 3))
    x = _rms_norm(h, weights[1], eps)
    if fused(x):
        gate, up = product(x, 2, g_n + u_n).split([g_n, u_n], dim=-1)
    else:
        gate, up = separate(x, 4), separate(x, 5)
    y = F.silu(gate) * up
    return h + (product(y, 3, d_n) if fused(y) else separate(y, 6))


def _attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Grouped-query attention of ``q`` [rows, heads, n, d] over the first ``mask.shape[-1]`` slots, as
    two batched products and a softmax in fp32: for the few queries of decoding, the CPU's fused
    attention kernel costs more in set-up than these; longer inputs (a prefill) take that kernel. Compiled on
    a CPU, one query a row is two reductions instead, and so are a few queries in bf16
    (:func:`_few_query_attention`)."""
    rows, heads, n, d = q.shape
    kv_heads, span = k_buf.shape[1], mask.shape[-1]
    if n > FEW_QUERIES:  # a prefill: the fused kernel, which never holds the whole score matrix
        return F.scaled_dot_product_attention(
            q, k_buf[:, :, :span], v_buf[:, :, :span], attn_mask=mask, scale=scaling, enable_gqa=True
        )
    groups = heads // kv_heads
    few = 1 < n <= FEW_QUERY_REDUCTIONS and q.dtype in REDUCED_QUERY_DTYPES
    if few and q.device.type == "cpu" and torch.compiler.is_compiling():
        return _few_query_attention(q, k_buf, v_buf, mask, scaling)
    if n == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
        # one query a row: two reductions inductor generates, in fp32, read the keys and values once with no
        # call into a library (faster in bf16, no slower in fp32)
        qg = q.reshape(rows, kv_heads, groups, 1, d).float()
        scores = (qg * k_buf[:, :, :span].unsqueeze(2).float()).sum(-1) * scaling  # [rows, kv, groups, span]
        weights = torch.softmax(scores.masked_fill(~mask.view(span), float("-inf")), dim=-1)
        out = (weights.unsqueeze(-1) * v_buf[:, :, :span].unsqueeze(2).float()).sum(-2)
        return out.to(q.dtype).view(rows, heads, n, d)
    qg = q.reshape(rows, kv_heads, groups * n, d)  # head h reads kv head h // groups, as transformers repeats
    keys = k_buf[:, :, :span]  # a strided view: each row's slots lie a whole capacity apart
    if q.dtype == torch.bfloat16:  # bf16 products read that view faster as K q^T (fp32 ones as q K^T)
        scores = torch.matmul(keys, qg.transpose(-1, -2)).transpose(-1, -2).float() * scaling
    else:
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scaling
    scores = scores.view(rows, kv_heads, groups, n, span).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(q.dtype).view(rows, kv_heads, groups * n, span)
    return torch.matmul(weights, v_buf[:, :, :span]).view(rows, heads, n, d)


FEW_QUERY_REDUCTIONS = 8
"""Up to this many queries a row (a verification of gamma + 1 tokens), compiled on a CPU in a dtype of
:data:`REDUCED_QUERY_DTYPES`, attention's scores are one reduction a query (:func:`_few_query_attention`)."""
REDUCED_QUERY_DTYPES = (torch.bfloat16,)
"""bf16 only: in fp32 on AVX2 the reductions made SD's and MTAD's target calls slower than the batched
products at one thread."""


def _few_query_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of a few queries a row as reductions inductor generates, in fp32: each query's scores a
    reduction over the head dimension (inductor fuses them into one pass over the keys), the output a
    reduction over the keys. No call into a library, so no copy of the strided key and value views and
    no hand-off to the thread pool: SD's and MTAD's bf16 target calls (a verification of a few tokens) run
    faster than with two batched products, at one thread and more so at two."""
    rows, heads, n, d = q.shape
    kv_heads, span = k_buf.shape[1], mask.shape[-1]
    groups = heads // kv_heads
    qg = q.reshape(rows, kv_heads, groups * n, d).float()  # head h reads kv head h // groups
    keys = k_buf[:, :, :span].float()
    scores = torch.stack([(qg[:, :, i, None, :] * keys).sum(-1) for i in range(groups * n)], dim=2) * scaling
    weights = torch.softmax(scores.view(rows, kv_heads, groups, n, span).masked_fill(~mask, float("-inf")), dim=-1)
    out = (weights.view(rows, kv_heads, groups * n, span, 1) * v_buf[:, :, None, :span].float()).sum(-2)
    return out.to(q.dtype).view(rows, heads, n, d)


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for the few tokens of one row. Compiled: for each token a product and a sum, which
    inductor fuses into one reduction over each row of ``weight`` that loads the row once for all the
    tokens (a broadcast over the tokens instead reads it once a token); uncompiled (a prefill): ``F.linear``."""
    if not torch.compiler.is_compiling():
        return F.linear(x, weight)
    if x.shape[-2] == 1:
        return (x.unsqueeze(-2) * weight).sum(-1)
    tokens = [(x[..., i : i + 1, :].unsqueeze(-2) * weight).sum(-1) for i in range(x.shape[-2])]
    return torch.cat(tokens, dim=-2)


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: normalised in fp32, scaled in the input's dtype."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cache_per_capability() -> str:
    """Point inductor's on-disk cache at a folder of its own for the CPU capability PyTorch dispatches to
    (``cpu-avx512`` under ``TORCHINDUCTOR_CACHE_DIR`` or inductor's default); returns that folder.

    Inductor's cache keys leave out a capability forced with ``ATEN_CPU_CAPABILITY`` (how an AVX2-only
    CPU is emulated on an AVX-512 one), and code cached under one capability, loaded under the other,
    gave wrong logits or corrupted the heap (torch 2.13, fp32, both product layouts). One folder per
    capability keeps the two apart."""
    leaf = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(os.path.normpath(base)) != leaf:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, leaf)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def discard_broken_cache(exc: BaseException) -> str | None:
    """When ``exc`` (or what caused it) names a file in inductor's on-disk cache, move that cache away, empty
    inductor's in-memory caches and return the line that names the file, so that compiling again writes
    every file anew; None (and nothing touched) otherwise.

    Seen: a compile killed mid-write (a Ctrl-C during the first load) left a zero-byte library in the cache,
    and every later process failed to load it ("file too short"), or failed to build a wrapper against it.
    A compiler that fails on a sound cache fails again on the empty one, so it costs one more compile
    and the cache, then the error is raised as before."""
    from torch._inductor.utils import clear_caches

    cache = os.path.normpath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    lines, chain, seen = [], set(), exc
    while seen is not None and id(seen) not in chain:  # causes can loop back: each exception once
        chain.add(id(seen))
        lines += str(seen).splitlines()
        seen = seen.__cause__ or seen.__context__
    naming = [line.strip() for line in lines if os.path.join(cache, "") in line]
    if not naming:
        return None
    named = next((line for line in naming if "Error: " in line), naming[0])[:400]  # the error, not a command
    aside = f"{cache}.broken-{os.getpid()}-{time.monotonic_ns()}"
    with contextlib.suppress(OSError):
        os.rename(cache, aside)  # atomic: another process reading it sees a whole folder or none
    shutil.rmtree(aside, ignore_errors=True)
    clear_caches()
    return named


def decoder_layers(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    layers: list[LayerWeights],
    head_dim: int,
    scaling: float,
    eps: float,
) -> torch.Tensor:
    """:func:`decoder_layer` for each of ``layers`` in turn, with its own key and value buffers."""
    for (weights, form, widths), k_buf, v_buf in zip(layers, keys, values, strict=True):
        h = decoder_layer(h, cos, sin, mask, slots, k_buf, v_buf, weights, form, widths, head_dim, scaling, eps)
    return h


Start = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, float]
"""What turns token ids into a forward's first hidden states and rotary tables (:func:`start_of`): the
embedding's matrix, a shortlist embedding's row of each token id (None for a plain embedding), the rotary
embedding's inverse frequencies and its attention scaling."""

End = tuple[str, torch.Tensor, float, tuple[torch.Tensor, ...], int]
"""What turns a forward's last hidden states into its logits (:func:`end_of`): the head's form (``gemv``: the
output matrix streamed by a reduction; ``int8``: a shortlist draft's int8 head through PyTorch's int8 kernel;
``packed``: a head prepacked for oneDNN), the final norm's weight and epsilon, the head's tensors and its
output width."""

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary embeddings whose inverse frequencies never change with the input (transformers' dynamic and long-RoPE
kinds recompute them from the sequence length, so their tables are made outside the graph)."""


def start_of(model: torch.nn.Module) -> Start | None:
    """:data:`Start` of ``model`` for its compiled forwards, or None where the embedding or the rotary embedding
    is not one whose arithmetic :func:`embed` repeats exactly (those run as the model's own modules)."""
    inner = model.model
    embedding, rope = inner.embed_tokens, inner.rotary_emb
    row_of = getattr(embedding, "row_of", None)
    if type(embedding) not in (torch.nn.Embedding, shortlist_draft.ShortlistEmbedding):  # a subclass may scale
        return None
    if getattr(rope, "rope_type", None) not in STATIC_ROPE_TYPES or not isinstance(rope.inv_freq, torch.Tensor):
        return None
    return embedding.weight, row_of, rope.inv_freq, float(rope.attention_scaling)


def embed(ids: torch.Tensor, positions: torch.Tensor, start: Start) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [rows, n, hidden] of ``ids`` [rows, n] and the rotary tables [1, 1, n, head_dim] at
    ``positions`` [n]: the embedding lookup, and transformers' rotary arithmetic (fp32 angles, scaled, cast)."""
    weight, row_of, inv_freq, attention_scaling = start
    h = F.embedding(ids if row_of is None else row_of[ids], weight)
    freqs = positions[:, None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    return h, cos.to(h.dtype)[None, None], sin.to(h.dtype)[None, None]


def end_of(model: torch.nn.Module, layers: list[LayerWeights], rows: int, keep: int) -> End | None:
    """:data:`End` of ``model`` for a compiled forward that keeps ``keep`` positions of ``rows`` rows with
    ``layers``' forms, or None where its head runs as the model's own module: in the ``gemv`` form the output
    matrix when the kept positions are few enough to reduce against it; in the ``int8`` form (one row) an int8
    draft's shortlist head through the same kernel as its layers; in the ``packed`` form a head that oneDNN
    multiplies by, prepacked (the target's output layer, an int8 draft's shortlist head over several rows)."""
    inner = model.model
    norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
    lm_head = head(model)
    lm_head = lm_head if lm_head is getattr(model, "lm_head", None) and getattr(lm_head, "bias", 0) is None else None
    int8_head = model.int8_head() if getattr(model.config, "int8_layers", False) else None
    form = layers[0][1]
    if form == "gemv" and lm_head is not None:
        if _fits(keep, lm_head.in_features, lm_head.weight.element_size()):
            return "gemv", *norm, (lm_head.weight,), lm_head.out_features
    if form == "int8" and rows == 1 and keep == 1 and int8_head is not None:
        kernel = int8_head.kernel_tensors(norm[0].dtype)
        if kernel is not None:
            return "int8", *norm, kernel, int8_head.out_features
    if form == "packed" and lm_head is not None and callable(getattr(lm_head, "packed", None)):
        return "packed", *norm, (lm_head.packed(),), lm_head.out_features
    if form == "packed" and int8_head is not None and int8_head.kernel == "onednn":
        return "packed", *norm, (int8_head.onednn_matrix(norm[0].dtype),), int8_head.out_features
    return None


def logits_of(h: torch.Tensor, end: End) -> torch.Tensor:
    """The final norm and the head of :data:`End` over ``h`` [rows, keep, hidden]."""
    form, norm, eps, tensors, width = end
    x = _rms_norm(h, norm, eps)
    if form == "gemv":  # the largest matrix a small model reads (SmolLM2's 49,152 x 576), streamed like the layers'
        return _gemv(x, tensors[0])
    if form == "int8":
        return int8_linear(x, *tensors, width)
    return packed_linear(x, tensors[0], width)


def _shares(tensor: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether ``tensor`` shares its storage with any of ``others`` (a head tied to the embedding)."""

    def storage(t: torch.Tensor) -> int | None:
        return t.untyped_storage().data_ptr() if t.layout == torch.strided and not t.is_mkldnn else None

    return storage(tensor) in {storage(o) for o in others} - {None}


def forward_part(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor,
    slots: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    layers: list[LayerWeights],
    head_dim: int,
    scaling: float,
    eps: float,
    start: Start | None = None,
    end: End | None = None,
    keep: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Some of a forward's decoder layers (:func:`decoder_layers`) in one call, and in the first call the
    embedding and rotary tables, in the last the head (:func:`llama_forward` says where), so that none of it
    is a call of its own (a small draft's forward is short enough for each call's host work to show): with
    ``start``, ``x`` is token ids [rows, n] and ``cos`` their positions [n], None for ``slots`` (:func:`embed`);
    else ``x`` is hidden states and ``cos``, ``sin`` the tables. Returns the hidden states, or with ``end`` the
    logits of the last ``keep`` positions (:func:`logits_of`), and the tables for the next call."""
    if start is not None:
        x, cos, sin = embed(x, slots if cos is None else cos, start)
    h = decoder_layers(x, cos, sin, mask, slots, keys, values, layers, head_dim, scaling, eps)
    return (h if end is None else logits_of(h[:, -keep:], end)), cos, sin


RECOMPILE_LIMIT = 256
"""Graphs dynamo keeps per compiled function (its default is 8): a forward has one per model width, form,
row count and token count (a second pair in the process, the page's, adds its own); a fused rule
(:mod:`mtad.decoding.fused`) one per combination of greedy or sampling, top-p and temperature on or off, τ
below 1 or not, and a first and a dynamic shape. Past it dynamo runs the function uncompiled, silently."""


UNCOMPILED: dict[str, str] = {}
"""Each forward shape dynamo declined to compile in this process (past a graph limit, or a failed compile),
described for a reader (``"SmolLM2 target, 1 row, 5 tokens (gemv form)"``), and why: the status line and the
bench's environment record name them. Empty when every forward ran compiled."""


def frames_declined() -> int:
    """Frames dynamo was asked to compile and did not (``counters["frames"]``: total less ok): it runs them
    uncompiled from then on."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"] - frames["ok"]


def uncompiled_shapes() -> list[str]:
    """:data:`UNCOMPILED`'s shapes with their reasons, for a reader."""
    return [f"{shape} ({why})" for shape, why in UNCOMPILED.items()]


def hold_graph_limits() -> None:
    """Raise dynamo's graph limits to :data:`RECOMPILE_LIMIT` in the calling thread. Dynamo's settings are
    per thread and context (each a ``ContextVar``), so a value set once at import holds only where it was set:
    the page's loading and lane threads compiled under the default of 8 and ran forwards uncompiled past it.
    Called before every compiled call; reading the two settings costs about a microsecond."""
    config = torch._dynamo.config
    if config.recompile_limit < RECOMPILE_LIMIT:
        config.recompile_limit = RECOMPILE_LIMIT
    if config.accumulated_recompile_limit < 4 * RECOMPILE_LIMIT:
        config.accumulated_recompile_limit = 4 * RECOMPILE_LIMIT


REALIZE_REUSED = {"realize_reads_threshold": 1}
"""Inductor's options for every compiled forward: keep a value that several kernels read in a buffer. By
default inductor inlines a cheap one into each reader: in the ``gemv`` form a reduction over a matrix then
recomputed the norm for every row of the matrix (a five-token output head several times slower), and one-query
attention recomputed the query's rotary embedding for every key it scores."""

# The layers' weights are inputs, so one graph of a few layers serves every run of that many layers of every
# model of those shapes: a new (rows, tokens) shape compiles it once, in seconds, not a whole model's graph.
compiled_layers = torch.compile(forward_part, options=REALIZE_REUSED)


def gemv_part(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_part` as the ``gemv`` form compiles it: its own function, so its compiled code sits
    apart from the other forms' and a call checks only its own cache entries."""
    return forward_part(*args)


compiled_gemv_layers = torch.compile(gemv_part, options=REALIZE_REUSED)

MOST_LAYERS_PER_CALL = 6
"""The most decoder layers one compiled call runs. Each call costs host work (guards, the compiled
wrapper's own code), so fewer calls make a forward faster, though by less with each layer added to a call;
a call of more layers takes longer to compile."""


def layers_per_call(count: int) -> int:
    """How many of a model's ``count`` decoder layers each compiled call runs: the largest divisor of
    ``count`` up to :data:`MOST_LAYERS_PER_CALL`, so every call of a model is the same graph (30 layers: 6,
    a shortlist draft's 2: 2)."""
    return max(d for d in range(1, MOST_LAYERS_PER_CALL + 1) if count % d == 0)


def llama_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    keep: int,
    layers: list[LayerWeights],
    compiled: bool = True,
) -> torch.Tensor:
    """Logits [rows, keep, V] of the last ``keep`` of ``ids`` [rows, n] at rotary ``positions`` [n], their
    keys and values written at cache ``slots`` [n]; ``mask`` [n, S] (True = attend) over the first S slots.
    ``layers``: :func:`layer_weights` of each layer. The decoder layers run in runs of :func:`layers_per_call`,
    compiled or not. Compiled, a model whose layers fit one call (a draft) also embeds the tokens and applies
    the head in it where :func:`start_of` and :func:`end_of` allow, and a model of several calls applies the
    ``gemv`` form's head in its last; elsewhere the model's own modules run them eagerly (a shortlist draft's
    logits cover its shortlist only)."""
    inner = model.model
    rows = ids.shape[0]
    step = layers_per_call(len(layers))
    one_call = step == len(layers)
    # Each end in a call of its own graph: a model of several calls (SmolLM2's 30 layers) would compile three
    # graphs a shape instead of one, which made the bench's warm-up far longer for next to nothing a forward; there
    # only the gemv form's head, which was a compiled call of its own anyway, joins the last call.
    start = start_of(model) if compiled and one_call else None
    end = end_of(model, layers, rows, keep) if compiled and (one_call or layers[0][1] == "gemv") else None
    if start is not None and end is not None and _shares(start[0], *end[3]):
        # a tied head in the call that embeds: dynamo guards arguments that alias each other, and working out
        # why such a guard failed raised IndexError at the next recompilation (torch 2.13), so it embeds eagerly
        start = None
    if start is None:
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions.view(1, -1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:  # the first compiled call embeds them, at the slots when the positions are those (no argument twice);
        # copies made in this mode, as the embedding's output was, so a caller's ids made outside inference mode
        # and another's made in it are the same graph's input
        h, cos, sin = ids.clone(), None if positions is slots else positions.clone(), None
    if compiled:
        hold_graph_limits()
        cache_per_capability()
        hold_widths(start, end)
        torch._dynamo.mark_dynamic(mask, 1)  # a longer context is the same graph
        if rows > 1:
            torch._dynamo.mark_dynamic(h, 0)  # and so is any count of rows from two on (beams, drafts)
    attn = inner.layers[0].self_attn
    eps = inner.layers[0].input_layernorm.variance_epsilon
    if not compiled:
        h = decoder_layers(h, cos, sin, mask, slots, keys, values, layers, attn.head_dim, attn.scaling, eps)
        return head(model)(inner.norm(h[:, -keep:]))
    run = compiled_gemv_layers if layers[0][1] == "gemv" else compiled_layers
    declined = frames_declined()
    for i in range(0, len(layers), step):
        part = slice(i, i + step)
        first, last = start if i == 0 else None, end if i + step == len(layers) else None
        args = (h, cos, sin, mask, slots, keys[part], values[part], layers[part], attn.head_dim, attn.scaling, eps)
        h, cos, sin = run(*args, first, last, keep)
    if frames_declined() > declined:  # dynamo gave up on this shape: it runs uncompiled, and the page says so
        name = type(model).__name__.removesuffix("ForCausalLM")
        UNCOMPILED[f"{name}, {rows} row{'s' if rows > 1 else ''}, {ids.shape[1]} tokens ({layers[0][1]} form)"] = (
            f"past dynamo's limit of {torch._dynamo.config.recompile_limit} graphs, or a failed compile"
        )
    return h if end is not None else head(model)(inner.norm(h[:, -keep:]))
