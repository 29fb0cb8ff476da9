"""A shortlist draft that also reads the target's features where they are known (after EAGLE, Li et
al., ICML 2024).

The shortlist draft (:mod:`mtad.models.shortlist_draft`) reads tokens only. This one adds to the input
embedding of a token x_p a linear map of the target's last hidden state f_{p-1}, which the target's
verification forward computes anyway and which holds far more of the context than the draft's two layers
can. Draft tokens read no feature (the target has not run them): they attend to the positions that did.
The map starts at zero, so a draft made from a trained shortlist draft (:meth:`from_draft`) starts as
exactly that draft, and training can only add what the features give. Logits and the shortlist are the
shortlist draft's: q = 0 off the shortlist, every verification rule stays exact.

Registered with transformers' Auto classes (``model_type = "mtad_feature_draft"``) when imported, so
``AutoModelForCausalLM.from_pretrained`` loads one without ``trust_remote_code``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from mtad.models.shortlist_draft import ShortlistConfig, ShortlistForCausalLM


class FeatureDraftConfig(ShortlistConfig):
    """A shortlist draft's config; its checkpoints hold the feature map too."""

    model_type = "mtad_feature_draft"


class FeatureDraftForCausalLM(ShortlistForCausalLM):
    """:class:`ShortlistForCausalLM` with ``embedding(x_p) + feature_in(rms(f_{p-1}))`` as its input."""

    config_class = FeatureDraftConfig
    config: FeatureDraftConfig
    reads_features = True
    """Decoders feed this draft the target's features (``features=``) besides token ids."""

    def __init__(self, config: FeatureDraftConfig) -> None:
        super().__init__(config)
        self.feature_in = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        nn.init.zeros_(self.feature_in.weight)

    @classmethod
    def from_draft(cls, draft: ShortlistForCausalLM) -> FeatureDraftForCausalLM:
        """This draft with a zero feature map: the same logits as ``draft`` whatever the features."""
        if not isinstance(draft, ShortlistForCausalLM):
            raise ValueError(f"not a shortlist draft: {type(draft).__name__}")
        cfg = FeatureDraftConfig(**draft.config.to_dict())
        cfg.architectures = [cls.__name__]
        param = next(draft.parameters())
        model = cls(cfg).to(device=param.device, dtype=param.dtype)
        missing, unexpected = model.load_state_dict(draft.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.startswith("feature_in.")]:
            raise ValueError(f"not a shortlist draft of this shape: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            model.feature_in.weight.zero_()
        return model

    def feature_term(self, features: torch.Tensor) -> torch.Tensor:
        """What a feature adds to its token's embedding: the map of the feature scaled to unit RMS (a
        target's features can be far larger than the draft's embeddings; zero features add zero)."""
        return self.feature_in(F.rms_norm(features, (features.shape[-1],), eps=1e-6))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        features: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """:meth:`ShortlistForCausalLM.forward` (every other argument goes to it as it is); ``features``
        [B, T, hidden]: the target's feature at each token's previous position, zeros where it is not known
        (None: none known)."""
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        if features is not None:
            inputs_embeds = inputs_embeds + self.feature_term(features.to(inputs_embeds.dtype))
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


AutoConfig.register(FeatureDraftConfig.model_type, FeatureDraftConfig, exist_ok=True)
AutoModelForCausalLM.register(FeatureDraftConfig, FeatureDraftForCausalLM, exist_ok=True)
