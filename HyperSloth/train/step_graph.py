"""CUDA graphs over the bucket shapes: the decoder's forward and backward of a packed row, replayed.

Why: a Qwen3-0.6B micro-batch is launch-bound. On an H200 its eager forward+backward took 0.257 s at 8,192
and at 16,384 tokens alike (scripts/graph_check.py): thousands of kernel launches, the GPU idle most of the
time. Packed rows already come in a handful of lengths (`collate.bucket_tokens`, about eight per doubling),
which is what a graph needs: capture the decoder's forward and its backward once per row length, then
replay them for every later row of that length, two launches instead of thousands.

What is graphed: the decoder body (embedding, every layer with its LoRA adapters, the final norm), as two
graphs per row length: its forward, and its backward to the trainable parameters. The loss stays eager:
Unsloth's fused cross-entropy keeps only the target rows (`nonzero`, a data-dependent shape that no graph
can hold), and it costs a few launches. So the loss, its scale and the gradient the decoder receives are
computed exactly as without graphs.

What a replay may and may not change (everything else is baked into a graph at capture):
- Per replay (static buffers, refilled before each replay): token ids, position ids, the segment lengths
  and their offsets (`cu_seqlens`), and the gradient arriving from the loss.
- Per run (`GraphLayout`): the number of segments (unused entries are zero-length segments that repeat the
  final offset; the varlen kernel skips them) and the attention kernel's `max_seqlen`, at least every
  segment of every row a graph serves. A replay with a stale, too small `max_seqlen` would silently drop
  attention blocks (transformers #45323), so rows outside the layout run eagerly (`GraphLayout.refusal`).
- Per graph: the row length (the key) and the host-side choices the model's Python made at capture.

Gradients: the backward graph writes d(decoder)/d(trainable parameters) into its own static tensors and
`_Replay.backward` adds them to `param.grad`, so micro-batches accumulate as eager `backward()` calls do.

Eager is the fallback, with one log line saying why (`graph_unavailable`, `GraphLayout.refusal`, a failed
capture): the eager path is the same model call, so CPU tests exercise everything but the capture.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import torch
from loguru import logger


class GraphLayout:
    """What every graph of a run shares: the longest row, the segment capacity and the attention kernel's
    launch bound."""

    def __init__(self, segments: int, max_seqlen: int, max_rows: int):
        self.segments = int(segments)  # entries of the lengths buffer: samples, plus the padding segments
        self.max_seqlen = int(max_seqlen)  # >= every segment (samples and padding) of every graphed row
        # The largest graphed row (`graph_layout`): the graph pool (about that row's activations, shared by all
        # graphs, held for the whole run) plus any row that runs eagerly beside it, a new length's warm-up
        # included, never hold more than the token budget's row did.
        self.max_rows = int(max_rows)

    def refusal(self, lengths: np.ndarray) -> str | None:
        """Why a row with these segment lengths cannot use the graphs (None: it can)."""
        rows = int(lengths.sum())
        if rows > self.max_rows:
            return f"rows over {self.max_rows} tokens (graph pool + the largest eager row within the token budget)"
        if len(lengths) > self.segments:
            return f"a row of {len(lengths)} segments (the graphs hold {self.segments})"
        longest = int(lengths.max()) if len(lengths) else 0
        if longest > self.max_seqlen:
            return f"a segment of {longest} tokens (the graphs' attention bound is {self.max_seqlen})"
        return None

    def as_dict(self) -> dict[str, int]:
        return {"segments": self.segments, "max_seqlen": self.max_seqlen, "max_rows": self.max_rows}


def graph_rows_limit(token_budget: int, longest_row: int | None = None) -> int:
    """The largest row that may be graphed. The graph pool holds about one graphed row's activations for
    the whole run, so a graphed row G and any row R that runs beside it eagerly (a longer one, or a new
    length's warm-up before its capture) must satisfy G + R <= token budget: memory grows linearly in
    tokens and the budget's row is what the probe proved to fit. Half the budget when the plan's longest
    row (`longest_row`) is graphed too; budget - longest row when that row is longer than half and runs
    eagerly. (Qwen3-8B 4-bit, budget 28,416 with 22k-token rows: a half-budget rule let a 6,144-token graph
    pool of 26 GiB sit beside 22k-token eager rows, out of memory at step 3.)"""
    half = int(token_budget) // 2
    if longest_row is None or int(longest_row) <= half:
        return half
    return max(int(token_budget) - int(longest_row), 0)


def graph_layout(samples_per_micro_batch: int, longest_sample: int, token_budget: int,
                 longest_row: int | None = None) -> GraphLayout:
    """The layout of a run whose graphed rows hold at most `graph_rows_limit(token_budget, longest_row)`
    tokens (`GraphLayout.max_rows`): room for every sample of a micro-batch plus the padding segments a
    bucket can add to such a row (its padding is under an eighth of the row, `collate.bucket_tokens`, cut
    into segments of at most `collate.PAD_SEGMENT_TOKENS`), and a `max_seqlen` (a power of two) covering the
    longest sample and the longest padding segment."""
    from HyperSloth.train.collate import PAD_SEGMENT_TOKENS, padding_segments

    max_rows = graph_rows_limit(token_budget, longest_row)
    max_padding = max(max_rows // 8, 64)
    longest = max(int(longest_sample), min(PAD_SEGMENT_TOKENS, max_padding), 1)
    return GraphLayout(segments=int(samples_per_micro_batch) + len(padding_segments(max_padding)),
                       max_seqlen=1 << (longest - 1).bit_length(), max_rows=max_rows)


def padded_segments(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment lengths padded with zero-length segments to `capacity`, and their offsets (`cu_seqlens`,
    capacity + 1 entries, the unused tail repeating the final offset)."""
    if len(lengths) > capacity:
        raise ValueError(f"{len(lengths)} segments do not fit a capacity of {capacity}")
    padded = np.zeros(capacity, dtype=np.int32)
    padded[: len(lengths)] = lengths
    cu = np.zeros(capacity + 1, dtype=np.int32)
    np.cumsum(padded, out=cu[1:])
    return padded, cu


def rows_to_capture(row_counts: dict[int, int], layout: GraphLayout, max_graphs: int) -> list[int]:
    """The planned row lengths that get graphs, longest first: the `max_graphs` most frequent of those the
    layout serves (`GraphLayout.max_rows`)."""
    fit = {rows: n for rows, n in row_counts.items() if rows <= layout.max_rows}
    chosen = sorted(fit, key=lambda rows: (-fit[rows], -rows))[:max_graphs]
    return sorted(chosen, reverse=True)


def synthetic_row(rows: int, layout: GraphLayout, pad_token_id: int) -> dict[str, torch.Tensor] | None:
    """A packed micro-batch of `rows` tokens for capturing a graph before training (None if the layout
    cannot hold one). Segment lengths alternate between two values: the attention dispatch picks its kernel
    from the host lengths at capture, and picks the varlen kernel only when they vary."""
    from HyperSloth.train.collate import collate_packed

    base = min(layout.max_seqlen, -(-rows // max(layout.segments - 1, 1)) + 1)
    if base < 2 or base * (layout.segments - 1) < rows:
        return None
    lengths, total = [], 0
    while total < rows:
        n = min(base - len(lengths) % 2, rows - total)
        lengths.append(n)
        total += n
    samples = [(np.full(n, pad_token_id, dtype=np.int64),) * 2 for n in lengths]
    return collate_packed(samples, with_lengths=True, pad_to=rows, pad_token_id=pad_token_id)


def graph_unavailable(*, enabled: bool, cuda: bool, backend: str, mode: str, lora: bool, lora_dropout: float,
                      checkpointing: bool | str, tiled_mlp: bool = False, experts: int = 0) -> str | None:
    """Why this run's decoder runs eagerly (None: it replays CUDA graphs over its packed rows)."""
    if not enabled:
        return "CUDA graphs are switched off (training.cuda_graphs=False)"
    if not cuda:
        return "no CUDA device"
    if backend != "unsloth":
        return f"the {backend} backend reads packed rows on the host (CUDA graphs need the Unsloth backend)"
    if mode != "packed":
        return "sorted-pad micro-batches change shape every time (CUDA graphs serve packed rows)"
    if not lora:
        return "full fine-tuning (CUDA graphs serve LoRA training)"
    if lora_dropout > 0:
        return f"lora_dropout={lora_dropout}: a replay would repeat the captured dropout masks"
    if checkpointing:
        return "gradient checkpointing recomputes layers inside the backward (CUDA graphs need it off)"
    if tiled_mlp:
        return "Unsloth's tiled MLP sizes its tiles from each row on the host (CUDA graphs need it off)"
    if experts:
        # Unsloth's MoE path (unsloth_zoo temporary_patches/moe_utils.py, 2026.10.9) reads the tokens routed to
        # each expert on the host to size its grouped GEMMs and dequantisation plans: a capture would freeze one
        # step's routing into every replay.
        return (f"mixture of experts ({experts} experts): the experts' grouped GEMMs are sized on the host from each "
                "step's routing (a graph would replay one routing)")
    return None


def run_graph_refusal(description, backend: str, config: Any) -> str | None:
    """`graph_unavailable` on a run's settings (its RunDescription), its backend and its model's config: the
    trainer asks before capturing (trainer_args.decoder_graphs), the attention setting before picking a kernel."""
    from HyperSloth.train.model_config import num_experts

    lora = description.hyper_config.lora_args
    return graph_unavailable(
        enabled=description.cuda_graphs, cuda=torch.cuda.is_available(), backend=backend, mode=description.batching,
        lora=lora is not None, lora_dropout=lora.lora_dropout if lora else 0.0,
        checkpointing=description.gradient_checkpointing, tiled_mlp=description.tiled_mlp is True,
        experts=num_experts(config) if config is not None else 0)


class _Graph:
    """The two graphs of one row length and the static tensors they read and write."""

    def __init__(self, rows: int, segments: int, device: torch.device):
        self.input_ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        # Lengths and offsets travel in one pinned buffer and one asynchronous copy (a pageable copy waits
        # for the GPU to drain); the host buffer is rewritten only once its previous copy has run.
        self._meta_host = torch.zeros(2 * segments + 1, dtype=torch.int32, pin_memory=True)
        self._meta = torch.zeros(2 * segments + 1, dtype=torch.int32, device=device)
        self.lengths, self.cu_seqlens = self._meta[:segments], self._meta[segments:]
        self.host_lengths: tuple[int, ...] = ()  # the capture's row, for the attention's host-side choices
        self._copied: torch.cuda.Event | None = None
        self.forward = torch.cuda.CUDAGraph()
        self.backward = torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None
        self.grad_hidden: torch.Tensor | None = None
        self.grads: tuple[torch.Tensor, ...] = ()

    def fill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: np.ndarray, cu: np.ndarray) -> None:
        """Copy one row into the static tensors, in stream order, without waiting for the GPU."""
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.position_ids.copy_(position_ids, non_blocking=True)
        if self._copied is not None:
            self._copied.synchronize()
        meta = self._meta_host.numpy()
        meta[: len(lengths)] = lengths
        meta[len(lengths):] = cu
        self._meta.copy_(self._meta_host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()


class _Replay(torch.autograd.Function):
    """The decoder's output from the forward graph; its backward replays the backward graph and adds the
    parameter gradients to `param.grad`."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, graph: _Graph, params: tuple[torch.nn.Parameter, ...]):
        ctx.graph, ctx.params = graph, params
        graph.forward.replay()
        return graph.hidden.detach()

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor):
        graph = ctx.graph
        graph.grad_hidden.copy_(grad_hidden)
        graph.backward.replay()
        accumulate(ctx.params, graph.grads)
        return None, None, None


def accumulate(params: tuple[torch.nn.Parameter, ...], grads: tuple[torch.Tensor, ...]) -> None:
    """param.grad += grad for every parameter (a copy where param.grad is None), in a few launches."""
    present = [i for i, p in enumerate(params) if p.grad is not None]
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if present:
        torch._foreach_add_([params[i].grad for i in present], [grads[i] for i in present])
    if missing:
        copies = torch._foreach_mul([grads[i] for i in missing], 1.0)
        for i, copy in zip(missing, copies):
            params[i].grad = copy


class DecoderGraphs:
    """Replays the decoder body of packed training rows from CUDA graphs, one pair per row length.

    `install(decoder)` routes the decoder module's forward through `forward`; training rows of a new length
    are captured on first sight (one eager warm-up, then the capture), later ones replay. Anything else
    (evaluation, no grad, a padded batch, a KV cache, a row outside the layout) calls the decoder's own
    forward unchanged. `static_packed_info(lengths, cu_seqlens, host_lengths, max_seqlen)` makes the
    model's attention read the given device tensors for the row's segments without reading them back to
    the host (HyperSloth.train.patches.unsloth_static_packed_rows for Unsloth).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], layout: GraphLayout, *,
                 static_packed_info: Callable[..., AbstractContextManager], max_graphs: int = 48):
        self.params = tuple(params)
        self.layout = layout
        self.static_packed_info = static_packed_info
        self.max_graphs = max_graphs
        self.graphs: dict[int, _Graph] = {}
        self.disabled: str | None = None
        self.capture_traceback: str | None = None
        self.capture_failed_at: list[str] = []  # the innermost frames outside torch of a failed capture (`failed_at`)
        self.replays = 0
        self.eager_rows = 0
        # The replayed output needs an input that requires grad, or autograd would not call its backward.
        self._anchor = torch.zeros((), device=self.params[0].device, requires_grad=True)
        self._stream: torch.cuda.Stream | None = None  # made at the first capture
        self._pool = None
        self._told: set[str] = set()
        self._decoder = None
        self._original: Callable[..., Any] | None = None
        # The decoder's own output class (a multimodal model's reads fields such as `image_hidden_states`, None here)
        self._output_type: type | None = None

    def install(self, decoder: torch.nn.Module) -> None:
        """Route `decoder`'s forward (an instance attribute over the class's method) through the graphs."""
        self._decoder, self._original = decoder, decoder.forward
        decoder.forward = self.forward

    # ---- the forward the decoder runs ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        reason = self._ineligible(args, kwargs)
        if reason is not None:
            if reason:  # "" marks calls that are not training rows (evaluation, generation): no message
                self._tell(reason)
                self.eager_rows += 1
            return self._original(*args, **kwargs)
        lengths = np.asarray(kwargs["packed_seq_lengths"], dtype=np.int32)
        padded, cu = padded_segments(lengths, self.layout.segments)
        rows = int(kwargs["input_ids"].shape[-1])
        graph = self.graphs.get(rows)
        if graph is None:
            with without_autocast_cache():  # the warm-up and both captures record every cast
                graph = self._capture(rows, kwargs, padded, cu)
            if graph is None:
                self.eager_rows += 1
                return self._original(*args, **kwargs)
        graph.fill(kwargs["input_ids"], kwargs["position_ids"], padded, cu)
        self.replays += 1
        hidden = _Replay.apply(self._anchor, graph, self.params)
        return _output(hidden, self._output_type)

    def _ineligible(self, args, kwargs) -> str | None:
        lengths = kwargs.get("packed_seq_lengths")
        if args or not torch.is_grad_enabled() or not self._decoder.training or lengths is None:
            return ""
        if kwargs.get("input_ids") is None or kwargs.get("position_ids") is None or kwargs["input_ids"].shape[0] != 1:
            return ""
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") or kwargs.get("inputs_embeds") is not None:
            return ""
        if kwargs.get("attention_mask") is not None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            return ""
        if not isinstance(lengths, torch.Tensor) or lengths.device.type != "cpu":
            return ""
        if self.disabled:
            return self.disabled
        refusal = self.layout.refusal(np.asarray(lengths))
        if refusal is not None:
            return refusal
        rows = int(kwargs["input_ids"].shape[-1])
        if rows not in self.graphs and len(self.graphs) >= self.max_graphs:
            return f"{self.max_graphs} row lengths have graphs already (the limit): new lengths run eagerly"
        return None

    # ---- capture ------------------------------------------------------------------------------
    def _capture(self, rows: int, kwargs: dict[str, Any], padded: np.ndarray, cu: np.ndarray) -> _Graph | None:
        """Warm up, then capture the forward and the backward graph of rows of this length."""
        graph = _Graph(rows, self.layout.segments, self.params[0].device)
        graph.fill(kwargs["input_ids"], kwargs["position_ids"], padded, cu)
        graph.host_lengths = tuple(int(x) for x in padded)
        call = dict(kwargs, input_ids=graph.input_ids, position_ids=graph.position_ids, packed_seq_lengths=graph.lengths)
        torch.cuda.synchronize()
        self._stream = self._stream or torch.cuda.Stream()
        # One side stream, the same for every warm-up and capture: libraries create their per-stream handles
        # and workspaces on it before a capture, not during it.
        self._stream.wait_stream(torch.cuda.current_stream())
        sync_mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(self._stream):
                hidden = self._decoder_hidden(graph, call)  # warm-up: compiles, tunes, fills caches
                torch.autograd.grad(hidden, self.params, torch.ones_like(hidden), allow_unused=True)
            del hidden
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's memory back to the driver, for the graph pool
            # A host sync inside a capture fails it with a CUDA error far from its cause: make torch raise
            # at the synchronising call itself (its traceback is kept in `capture_traceback`).
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.graph(graph.forward, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                graph.hidden = self._decoder_hidden(graph, call)
            graph.grad_hidden = torch.empty_like(graph.hidden)
            with torch.cuda.graph(graph.backward, pool=graph.forward.pool(), stream=self._stream,
                                  capture_error_mode="thread_local"):
                grads = torch.autograd.grad(graph.hidden, self.params, graph.grad_hidden, allow_unused=True)
                graph.grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads))
        except Exception as error:  # noqa: BLE001 - whatever fails a capture, training goes on eagerly
            torch.cuda.set_sync_debug_mode(sync_mode)
            self.capture_traceback = traceback.format_exc()
            first_line = (str(error).splitlines() or [""])[0][:200]
            self.disabled = f"CUDA graph capture failed ({type(error).__name__}: {first_line})"
            self.capture_failed_at = failed_at(error)
            self._tell(self.disabled + (f" at {self.capture_failed_at[-1]}" if self.capture_failed_at else ""))
            torch.cuda.synchronize()
            return None
        torch.cuda.set_sync_debug_mode(sync_mode)
        torch.cuda.current_stream().wait_stream(self._stream)
        graph.hidden = graph.hidden.detach()
        self._pool = graph.forward.pool()
        self.graphs[rows] = graph
        logger.info(f"CUDA graphs captured for packed rows of {rows} tokens ({len(self.graphs)} row lengths)")
        return graph

    def _decoder_hidden(self, graph: _Graph, call: dict[str, Any]) -> torch.Tensor:
        with self.static_packed_info(graph.lengths, graph.cu_seqlens, graph.host_lengths, self.layout.max_seqlen):
            output = self._original(**call)
            self._output_type = type(output)
            return output[0]

    def _tell(self, reason: str) -> None:
        if reason not in self._told:
            self._told.add(reason)
            logger.info(f"eager decoder forward+backward: {reason}")

    def summary(self) -> dict[str, Any]:
        """What the graphs did in this run (for the run summary)."""
        return {"row_lengths": sorted(self.graphs), "replays": self.replays, "eager_rows": self.eager_rows,
                "disabled": self.disabled, **self.layout.as_dict(),
                **({"capture_failed_at": self.capture_failed_at} if self.capture_failed_at else {})}


@contextmanager
def without_autocast_cache():
    """Autocast (training's forward runs under it) without its cache of cast weights, for a warm-up and a capture.
    The cache keeps a parameter's low-precision copy for the rest of the outermost autocast region: a capture
    after a warm-up in the same region would read the warm-up's copy, a tensor outside the graph pool that is
    freed when the region ends and stale once the optimizer moves the weight. torch refuses the cache in
    `make_graphed_callables` for that reason; here every cast is recorded in the graph and redone on replay."""
    was = torch.is_autocast_cache_enabled()
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def failed_at(error: BaseException, frames: int = 4) -> list[str]:
    """Where a failed capture's error came from: its innermost `frames` frames outside torch itself, as
    "path:line in function" (paths from their package on), innermost last. A host sync that fails a capture is
    raised at the synchronising call (sync debug mode "error"), so these name the model's or library's line that
    synchronised (Gemma 4 on Unsloth, 2026-12-05: not known without them)."""
    kept = [frame for frame in traceback.extract_tb(error.__traceback__)
            if "/torch/" not in frame.filename.replace("\\", "/")]
    return [f"{_package_path(frame.filename)}:{frame.lineno} in {frame.name}" for frame in kept[-frames:]]


def _package_path(filename: str) -> str:
    path = filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/", "unsloth_compiled_cache"):
        if marker in path:
            return (marker if marker == "unsloth_compiled_cache" else "") + path.split(marker, 1)[1]
    return "/".join(path.split("/")[-3:])


def _output(hidden: torch.Tensor, output_type: type | None = None):
    """The replayed hidden states in the decoder's own output class (its other fields None), so a caller that reads
    a field of its model's class (Gemma 3's multimodal model: `image_hidden_states`) finds it."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return (output_type or BaseModelOutputWithPast)(last_hidden_state=hidden)
