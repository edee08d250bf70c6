"""mindspec: a speculative-decoding-first inference stack for DeepSeek-V2/V3."""
__version__ = "0.1.0"
