from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0015_attempt_scale_probe"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="energy",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="Its GPUs' and hosts' energy meters so far, folded from health samples (jobs/energy.py; "
                "docs/power.md).",
            ),
        ),
    ]
