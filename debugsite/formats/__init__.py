"""The site's date and time formats (``FORMAT_MODULE_PATH``), one per language Django may pick."""
