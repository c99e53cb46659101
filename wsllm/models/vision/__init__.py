"""The image encoders and projectors of vision families (docs/vision.md)."""
