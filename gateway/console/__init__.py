"""The operator console: its data (``status``) and its page (``static/``)."""
