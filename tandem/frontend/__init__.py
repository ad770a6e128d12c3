"""Frontend: tokenizer, chat templates, incremental detokenizer, output processing, engine client."""
