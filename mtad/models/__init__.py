"""The model side: pairs and their presets, devices and dtypes, the CPU kernels, the drafts, GGUF.

Importing this package (any module of it) registers the shortlist draft (``model_type = "mtad_shortlist"``)
and the feature-reading draft (``"mtad_feature_draft"``) with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained`` loads either without remote code.
"""

from mtad.models import feature_draft, shortlist_draft  # noqa: F401  (register the drafts' classes)
