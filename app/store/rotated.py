"""Former home of the rotated codecs, kept so that older imports work: use `app.store.codecs`."""

from app.store.codecs import CLIPS, RotatedQuantCodec, hadamard

__all__ = ["CLIPS", "RotatedQuantCodec", "hadamard"]
