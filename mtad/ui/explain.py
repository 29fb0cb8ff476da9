"""The page's plain-language text: what SD guarantees, what MTAD trades, what tau does."""

from __future__ import annotations

INTRO = """\
# Speculative decoding vs MTAD
A small **draft** model guesses the next few tokens; the large **target** model checks all the guesses
in one forward pass and keeps the ones it agrees with. Type a prompt, press **Run**, and watch both
methods generate: which draft tokens were kept, which were thrown away, and what the target added itself.
"""

EXPLAIN = """\
### What you are looking at
* **Speculative decoding (SD)** drafts γ tokens one by one and accepts token *i* with probability
  min(1, p_i/q_i), where p is the target's probability and q the draft's. At the first rejection it
  resamples from what the target wanted and the draft did not offer; if all pass it adds a bonus token.
  **Guarantee:** the text is distributed exactly as if the target had generated it alone, only faster.
* **MTAD** drafts with **beam search** (W beams), then judges whole prefixes by their **joint**
  probability: prefix j passes when min(1, p(x₁…x_j) / q(x₁…x_j)) > τ, and MTAD keeps the **longest**
  passing prefix plus one token from the target. It gives up SD's exact guarantee to approximate
  joint (multi-token) decoding, which usually lowers perplexity — and it often accepts more per target call.
* **τ** is MTAD's strictness. τ = 0 accepts every beam prefix the target does not rule out; τ = 1
  accepts nothing (MTAD becomes plain autoregressive decoding). In between, a higher τ demands that the
  target like the draft nearly as much as the draft liked itself.
* **Honest timing:** the lanes run one at a time on the device, each with its own clock (and energy meter);
  when the run ends, the race above the lanes replays them on one true time axis, and each card's **× AR**
  compares its speed with the AR lane of the same run. **Per target call** says what one target forward
  costs here, and in brackets how much more a verification of several tokens costs than AR's one-token
  forward. A decoder beats AR when it keeps more tokens per call than that ratio, with room to spare for
  drafting. On a CPU in fp32 the ratio grows with γ (on an AVX2 CPU about 1.1× for two tokens, 1.6× for
  five), so there a short draft, γ 1 or 2, often beats the paper's γ 4; fewer beams (W 2) draft faster.
  **Fastest γ and W on this device** times each candidate here and sets those predicted fastest.
  **Replay** re-animates the lanes themselves.
"""
