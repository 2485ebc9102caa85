"""The profile pages' routes, under ``/dashboard/profiles/``."""
from __future__ import annotations

from django.urls import path

from engines.views import profiles

urlpatterns = [
    path("compare/", profiles.profile_compare, name="dashboard-profile-compare"),
    path("<int:pk>/", profiles.profile_page, name="dashboard-profile"),
    path("<int:pk>/data.json", profiles.profile_data, name="dashboard-profile-data"),
    path("<int:pk>/profile.json.gz", profiles.profile_download, name="dashboard-profile-download"),
    path("<int:pk>/trace.json", profiles.profile_trace, name="dashboard-profile-trace"),
    path("<int:pk>/timeline/", profiles.profile_timeline, name="dashboard-profile-timeline"),
]
