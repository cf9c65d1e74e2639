"""python -m paddle_fastffn SCRIPT.py [ARGS...]: run a PaddleNLP script with the plugin loaded
(see paddle_fastffn/plugin.py)."""

from paddle_fastffn.plugin import main

if __name__ == "__main__":
    main()
