"""One time format across the product, for the admin and the templates: ``2026-12-01 20:02:56``,
24-hour, and ``20:02:56`` where only the time of day matters; the pages' scripts print the same
(static/engines/js/format.js).

Django localizes every date it prints, so its English locale's formats (``Dec. 1, 2026, 8:02
p.m.``) win over the settings of the same name: these, named by ``FORMAT_MODULE_PATH``, win over
the locale's. (Date *inputs* keep Django's own formats.)
"""
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i"
