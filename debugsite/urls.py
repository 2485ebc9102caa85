"""URL routes: the admin now; the API, debug and dashboard routes join as they land."""
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
