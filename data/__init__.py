"""Chat data: offline assets, streaming conversation readers, chat-template rendering with
assistant-only loss masks, the tokenised on-disk cache, and evaluation prompt sets."""
