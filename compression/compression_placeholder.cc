// Replaced by the codecs.
