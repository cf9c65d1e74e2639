"""The PaddleNLP-style fine-tune flow behind scripts/run_finetune.py, and the embedded demo."""
