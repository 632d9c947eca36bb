"""Any causal LM through transformers' own forward, its keys and values in the engine's paged cache.

The embedded engine's fallback for families without a native forward (`rollout/models/__init__.py`
chooses). transformers runs every layer as it always does; only two things are the engine's:

- the cache: `PagedCache` is a transformers `Cache` whose layers write each new token's K/V into
  the engine's `KVCache` (its block and offset) and hand back the row's positions 0..L-1, so blocks,
  batching and prefix reuse work exactly as for the native families;
- the mask: the batch's own [B, T, L] visibility, passed as an additive 4D mask, which transformers
  uses as given (a 4D mask skips its own mask construction).

What cannot work this way is refused when the model is built, never discovered mid-run: a family
whose layers keep something other than per-position K/V (recurrent or linear-attention state), a
sliding window shorter than the engine's context, FP8, and, checked by running it, any family whose
forward through this path does not give the logits of its own full forward (`_check_against_full_forward`).
Slower than a native forward (no fused projections, transformers' per-call overhead), but correct.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.initialization import no_init_weights

from ..fp8 import Fp8Error
from ..kv_cache import CacheLayout, ForwardBatch, KVCache, contiguous_tables
from .common import check_full_attention, last_tokens

log = logging.getLogger(__name__)

PROBE_TOKENS = 6
PROBE_BLOCK = 4
"""Length of the sequence the start-up check runs (prefilled in two pieces, then decoded)."""
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
"""Largest log-prob gap to the full forward accepted at start-up; half-precision dtypes get 5e-2."""


class _PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the engine's cache for the current forward."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: PagedCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.exchange(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        batch = self.owner.batch
        return (batch.context_len if batch is not None else query_length), 0

    def get_seq_length(self) -> int:
        # Positions always come with the batch; nothing should ask, and 0 is what a fresh cache says.
        return 0

    def get_max_length(self) -> int:
        return self.owner.cache.max_len if self.owner.cache is not None else -1


class PagedCache(Cache):
    """A transformers `Cache` over the engine's `KVCache` for one `ForwardBatch` at a time."""

    def __init__(self, cache: KVCache | None, batch: ForwardBatch | None, num_layers: int) -> None:
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self.cache, self.batch = cache, batch
        self.shapes: dict[int, dict[str, tuple[int, int]]] = {}
        """Layer -> cache name -> (heads, dim) of what each layer stored (read by the layout probe)."""

    def exchange(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, heads, T, dim] of the batch's real tokens; return [B, heads, L, dim] of its rows."""
        self.shapes[layer] = {"k": (keys.shape[1], keys.shape[3]), "v": (values.shape[1], values.shape[3])}
        cache, batch = self.cache, self.batch
        if cache is None or batch is None:  # the layout probe: nothing to store yet
            return keys, values
        cache.write(layer, "k", batch, keys.transpose(1, 2))
        cache.write(layer, "v", batch, values.transpose(1, 2))
        return cache.read(layer, "k", batch), cache.read(layer, "v", batch)


class TransformersModel:
    """The engine's model interface (`cache_layout`, `forward`, `hidden_states`, `logits`, `load_state_dict`)
    over transformers' own modules."""

    linear_keys: frozenset[str] = frozenset()
    fp8 = False

    def __init__(self, config, state_dict: dict, *, max_len: int, dtype: torch.dtype, device: torch.device, fp8: bool = False):
        family = config.model_type
        if fp8:
            raise Fp8Error(f"rollout.fp8: the generic transformers path ({family}) runs no FP8 weights; only native families do")
        _refuse_unsupported(config, max_len)
        self.config, self.dtype, self.device = config, dtype, device
        self.vocab_size = config.vocab_size
        # Built on its device without random initialisation (every weight is loaded next); buffers that
        # no state dict carries (RoPE frequencies) are computed by the constructor as usual.
        with torch.device(device), no_init_weights():
            module = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.module = module.eval()
        self.decoder = module.base_model
        self.head = module.get_output_embeddings()
        self.num_layers = config.num_hidden_layers
        self.load_state_dict(state_dict)
        self.layout = self._probe_layout()
        _check_against_full_forward(self)
        log.info("embedded engine: no native forward for %s; running transformers' own forward (slower, exact)", family)

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the policy's weights (transformers names; others, like a drafter's "mtp.*", are ignored as
        the native families ignore them). Checked whole before any is copied: all or nothing."""
        own = self.module.state_dict()
        tied = set(getattr(self.module, "all_tied_weights_keys", None) or {})
        missing = [name for name in own if name not in state_dict and name not in tied]
        reshaped = [name for name, t in own.items() if name in state_dict and state_dict[name].shape != t.shape]
        if missing or reshaped:
            raise KeyError(f"state dict does not fit {self.config.model_type}: missing {missing[:5]}, other shapes {reshaped[:5]}")
        self.module.load_state_dict({name: state_dict[name] for name in own if name in state_dict}, strict=False)

    def cache_layout(self, extra_layers: int = 0) -> CacheLayout:
        if extra_layers:
            raise ValueError("the generic transformers path has no MTP drafter (rollout.mtp_drafting needs a native family)")
        return list(self.layout)

    def _probe_layout(self) -> CacheLayout:
        """What each layer stores per position, read off one forward of two tokens."""
        probe = PagedCache(None, None, self.num_layers)
        tokens = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                self.decoder(input_ids=tokens, cache=probe, use_cache=True)
        except (TypeError, ValueError, AttributeError) as err:  # a forward that takes no `Cache`, or uses it otherwise
            raise ValueError(
                f"{self.config.model_type}: its forward does not run over a transformers Cache ({type(err).__name__}: {err}); "
                "the embedded engine cannot run it (use rollout.type='vllm')"
            ) from err
        if sorted(probe.shapes) != list(range(self.num_layers)):
            raise ValueError(
                f"{self.config.model_type}: layers {sorted(set(range(self.num_layers)) - set(probe.shapes))} keep no "
                "per-position keys and values (recurrent or linear attention); the embedded engine cannot run it (use rollout.type='vllm')"
            )
        return [probe.shapes[i] for i in range(self.num_layers)]

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Final normed hidden states [B, T, H]; K/V of every real token go into the cache."""
        # 0 where visible, the dtype's lowest where hidden: every row sees at least its own position.
        mask = torch.zeros(batch.mask.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~batch.mask, torch.finfo(self.dtype).min)
        paged = PagedCache(cache, batch, self.num_layers)
        out = self.decoder(input_ids=batch.tokens, attention_mask=mask[:, None], position_ids=batch.positions, cache=paged, use_cache=True)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [B, vocab] at each row's last token."""
        return self.logits(last_tokens(self.hidden_states(batch, cache), batch))


def _refuse_unsupported(config, max_len: int) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{config.model_type} is an encoder-decoder model, not a causal LM")
    check_full_attention(config, max_len)


def _check_against_full_forward(model: TransformersModel) -> None:
    """Refuse a family whose logits through the paged cache and the 4D mask differ from its own full forward:
    prefill two ragged pieces, then decode token by token, and compare every position's log-probs."""
    config, device = model.config, model.device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (PROBE_TOKENS,), generator=generator).to(device)
    # Small blocks, so that the probe's reads cross block boundaries as the engine's do.
    (table,) = contiguous_tables(1, PROBE_TOKENS, PROBE_BLOCK)
    cache = KVCache(model.layout, len(table), PROBE_BLOCK, max_len=PROBE_TOKENS, dtype=model.dtype, device=device)
    pieces = [(0, 3), (3, 4), *((p, p + 1) for p in range(4, PROBE_TOKENS))]
    with torch.inference_mode():
        full = model.module(input_ids=tokens[None], attention_mask=torch.ones_like(tokens[None])).logits[0].float().log_softmax(-1)
        ours = []
        for lo, hi in pieces:
            batch = ForwardBatch.build([table], [tokens[lo:hi].tolist()], [lo], PROBE_BLOCK, device)
            ours.append(model.logits(model.hidden_states(batch, cache))[0, : hi - lo])
        ours_logp = torch.cat(ours).float().log_softmax(-1)
    gap = float((full - ours_logp).abs().max())
    tolerance = PROBE_TOLERANCE.get(model.dtype, 5e-2)
    if not gap <= tolerance:
        raise ValueError(
            f"{config.model_type}: transformers' forward through the engine's cache differs from its own full forward "
            f"(log-prob gap {gap:.2e} > {tolerance:g}); the embedded engine cannot run this family (use rollout.type='vllm')"
        )
