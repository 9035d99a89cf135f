"""llama-server's RoPE options, as the workers' contexts take them.

`--rope-scaling {none,linear,yarn}`, `--rope-scale N` (a context N times the trained one, which
is `--rope-freq-scale 1/N`), `--rope-freq-base`, `--rope-freq-scale`, and YaRN's
`--yarn-orig-ctx`, `--yarn-ext-factor`, `--yarn-attn-factor`, `--yarn-beta-slow` and
`--yarn-beta-fast`, each with llama.cpp's meaning; one left unset is the model's own (its GGUF's
rope keys), as in llama-server.

Rules:
- Only the settings given reach the worker (`backend.context.load`'s `rope`), and they name
  other cache keys: positions rotated otherwise are other bits, so a state made without them is
  never restored with them. The ready line and /props say them.
- The draft model gets the same settings, as llama-server gives its draft model.
- A value llama.cpp would take and compute nonsense with (a scale or base of 0 or less, both
  spellings of the scale at odds) stops the start in one line.
"""

from __future__ import annotations

from typing import Any

# the Config fields, as llama-server spells them (`--rope-scaling` is field rope_scaling; its
# flags, variables and the workers' flags are made from these names)
FIELDS = ("rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx",
          "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow", "yarn_beta_fast")
SCALINGS = ("", "none", "linear", "yarn")


def settings(cfg: Any) -> dict[str, Any]:
    """The RoPE settings a Config gives (those not at the Config's default, the model's own),
    as `backend.context.load` takes them (`rope_scale` turned into the frequency scale it
    means); a ValueError in one line where llama.cpp would compute nonsense with them."""
    unset = cfg.__dataclass_fields__
    given: dict[str, Any] = {f: getattr(cfg, f) for f in FIELDS
                             if getattr(cfg, f) != unset[f].default}
    scale = given.pop("rope_scale", None)
    if scale is not None:
        if not scale > 0:
            raise ValueError(f"--rope-scale {scale}: give N > 0, the context N times the one "
                             "the model was trained with")
        if given.get("rope_freq_scale", 1.0 / scale) != 1.0 / scale:
            raise ValueError("--rope-scale N and --rope-freq-scale 1/N set one thing, and "
                             "disagree here: give one of them")
        given["rope_freq_scale"] = 1.0 / scale
    for f in ("rope_freq_base", "rope_freq_scale"):
        if f in given and not float(given[f]) > 0:
            raise ValueError(f"--{f.replace('_', '-')} {given[f]}: give a value above 0 (leave it "
                             "out for the model's own)")
    if int(given.get("yarn_orig_ctx", 0)) < 0:
        raise ValueError(f"--yarn-orig-ctx {given['yarn_orig_ctx']}: give the model's original "
                         "context in tokens (0: the one it was trained with)")
    return given
