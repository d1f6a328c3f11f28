"""The DFlash drafter's configuration, derived from the target's Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)  # the Hugging Face names, as config.json spells them
QWEN3_VOCAB_SIZE = 151936
QWEN3_MASK_TOKEN_ID = 151669  # an unused row of Qwen3's embedding (the public DFlash drafters use it)


def target_rope_theta(target_config) -> float:
    """The base RoPE theta of the target (transformers 5 keeps it in `rope_parameters`, 4.x in `rope_theta`).

    The drafter always uses plain ('default') RoPE at this base, even when the target scales its RoPE
    (Llama 3's 'llama3', gpt-oss's 'yarn'): the drafter is trained from scratch and never reuses the
    target's attention weights, so its RoPE only has to agree between training and serving; scaling
    schemes exist to stretch a model past the context it was pre-trained on, and the drafter's context
    is the one it is trained on. Plain RoPE also keeps the exported drafter servable everywhere.
    """
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(target_config, "rope_theta", None)
    if theta is None:
        raise ValueError("target config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def target_intermediate_size(target_config) -> int:
    """The target's MLP width; for a MoE without a dense width (Qwen3.5-MoE), the active experts' total."""
    width = getattr(target_config, "intermediate_size", None)
    if width:
        return int(width)
    experts = getattr(target_config, "num_experts_per_tok", None)
    expert_width = getattr(target_config, "moe_intermediate_size", None)
    if experts and expert_width:
        return int(experts) * int(expert_width)
    raise ValueError("target config has neither intermediate_size nor moe_intermediate_size and num_experts_per_tok")


def default_mask_token_id(vocab_size: int) -> int:
    return QWEN3_MASK_TOKEN_ID if vocab_size == QWEN3_VOCAB_SIZE else vocab_size - 1


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]  # len == num_layers
    sliding_window: int | None = None
    target_num_hidden_layers: int = 0  # the target's total decoder layers (0: unknown)

    def __post_init__(self) -> None:
        # Accept lists (e.g. from JSON) but store tuples so the config stays hashable.
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; allowed: {list(LAYER_TYPES)}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if any(i < 0 for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} has negative ids")
        if self.target_num_hidden_layers and max(self.target_layer_ids) >= self.target_num_hidden_layers:
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} exceed the target's "
                             f"{self.target_num_hidden_layers} layers")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")

    @property
    def num_target_layers(self) -> int:
        """How many target layers are fused (the `fc` input is num_target_layers * hidden_size)."""
        return len(self.target_layer_ids)

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_target(cls, target_config, target_layer_ids, *, num_layers: int = 5, block_size: int = 16,
                    mask_token_id: int | None = None, sliding_window: int | None = None) -> DrafterConfig:
        """A drafter for a Qwen3-like target: same width, heads, eps, RoPE base and vocabulary.

        `target_config` may be a multimodal wrapper's: sizes come from its text config.

        Every layer is "sliding_attention" when a `sliding_window` is given (one mask kind per step,
        and what vLLM serves without mixing cache groups), else "full_attention" (a mix of them:
        `dataclasses.replace(cfg, layer_types=...)`, checked as the constructor checks them);
        `mask_token_id` defaults to an unused embedding row.
        """
        layer_types = (FULL_ATTENTION if sliding_window is None else SLIDING_ATTENTION,) * num_layers
        c = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
        hidden = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        vocab = int(c.vocab_size)
        return cls(
            hidden_size=hidden,
            intermediate_size=target_intermediate_size(c),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(c.rms_norm_eps),
            rope_theta=target_rope_theta(c),
            max_position_embeddings=int(c.max_position_embeddings),
            vocab_size=vocab,
            block_size=block_size,
            mask_token_id=default_mask_token_id(vocab) if mask_token_id is None else int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            target_num_hidden_layers=int(getattr(c, "num_hidden_layers", 0) or 0),
        )
