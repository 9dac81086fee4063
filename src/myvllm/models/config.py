"""The hyper-parameters a model reads from its transformers config that need more than a lookup.

The models take the checkpoint's transformers config as it is (config.hidden_size,
config.num_key_value_heads, ...): the names match the checkpoint's config.json and
transformers' own model code. Two values need a rule, and transformers wrote them two ways:

    get_head_dim(config)     config.head_dim, else hidden_size // num_attention_heads
    rope_parameters(config)  (rope_theta, scaling dict or None) from either config form
"""

from __future__ import annotations

from typing import Any


def get_head_dim(hf_config: Any) -> int:
    """config.head_dim when set (Qwen3: 128 != 1024/16), else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def rope_parameters(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None for plain RoPE), from either config form.

    transformers 4 config.json: ``rope_theta`` + ``rope_scaling`` ({"rope_type": "llama3", ...}
    or null). transformers 5: one ``rope_parameters`` dict holding rope_theta and rope_type
    ("default" = no scaling). The returned dict always has "rope_type" and no "rope_theta".
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            # models/ imports nothing above layers/, so the refusal's form is written out here.
            raise ValueError(f"rope_parameters={params!r}: allowed: one dict for every layer "
                             "(per-layer-type rope_parameters are not supported)")
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling: dict | None = params
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
    if theta is None:
        raise ValueError("the model config's rope_theta=None (it has neither rope_theta nor "
                         "rope_parameters['rope_theta']): allowed: a number, RoPE's base")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = rope_type
    return float(theta), out
