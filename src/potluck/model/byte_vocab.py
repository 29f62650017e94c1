"""The byte vocabulary: UTF-8 bytes as ids 0-255, then ``<pad>`` 256, ``<bos>`` 257,
``<eos>`` 258 and ``<unk>`` 259.

It lives with the models because model shapes are made for it: the tiny
presets embed exactly its 260 ids, and the Hugging Face config made for a
byte-sized vocabulary names its special ids (:mod:`potluck.model.hf`). The
data layer's :class:`~potluck.data.tokenizer.ByteTokenizer` encodes text with
it, so data depends on the model and not the other way round.
"""

from __future__ import annotations

BYTES = 256  # ids 0-255: one per byte value
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(BYTES, BYTES + len(SPECIALS))
VOCAB_SIZE = BYTES + len(SPECIALS)
