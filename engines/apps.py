from django.apps import AppConfig


class EnginesConfig(AppConfig):
    name = "engines"
    verbose_name = "Inference engines"
    default_auto_field = "django.db.models.BigAutoField"
