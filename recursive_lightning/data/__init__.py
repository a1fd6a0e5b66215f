"""Data pipeline: text sources (``sources``, ``hub``, the embedded ``corpus``) -> tokenizer (``tokenizer``) ->
cached litdata token shards (``shards``) -> ``TextDataModule`` (``datamodule``); the embedded evaluation tasks
(``embedded_tasks``). Import the modules themselves: the package imports nothing, so a light module (the
corpus, the tokenizer) does not pull in torch and litdata."""
