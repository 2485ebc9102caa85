"""Only the admin, as debugsite.urls mounts it: these tests need no engine views."""
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
