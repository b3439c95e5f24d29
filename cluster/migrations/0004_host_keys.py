from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("cluster", "0003_node_poll_lease"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="host_key",
            field=models.TextField(blank=True, help_text="The node's pinned SSH host key ('type base64'); a different key is refused. Recorded on first contact (or from known_hosts); `manage.py trust NODE` replaces it."),
        ),
        migrations.AddField(
            model_name="node",
            name="host_key_pinned_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="node",
            name="host_key_source",
            field=models.CharField(blank=True, help_text="first use, known_hosts or trust", max_length=20),
        ),
    ]
