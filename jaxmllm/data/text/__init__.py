"""Text: token ids (`specials`, `tokenizer`, a checkpoint's tokenizer directory `pretrained`
with its `chat_template`) and the prompt templates of generation (`template`)."""
