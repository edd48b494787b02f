//! Generation (issue 30, in progress): decoder LLMs that write a completion for a prompt. So far
//! only the GGUF tokenizer ([`gguf_tokenizer`]): a GGUF file carries its vocabulary, merges and
//! pre-tokenizer name in its metadata rather than a `tokenizer.json`, and the ids must be the
//! ones the model was trained on.

pub mod gguf_tokenizer;
