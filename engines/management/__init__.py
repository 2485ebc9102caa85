"""The app's ``manage.py`` commands (``commands``)."""
